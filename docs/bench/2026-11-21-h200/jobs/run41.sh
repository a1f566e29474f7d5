#!/bin/bash
# GPU run 41 (session 9): SAAP classifier stages at B=1 and B=8 (with w2 stored transposed), SANTA
# pipeline-depth variants (shared memory per program) at 2 warps.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r41; mkdir -p $R
for b in 1 8; do timeout 60 python3 scripts/bench_saap_classifier.py --batch $b > $R/cls_b$b.txt 2>&1; echo "rc=$?" >> $R/cls_b$b.txt; cat $R/cls_b$b.txt | grep -v "^NVIDIA"; done
for var in default stream_bk32 bk64s2 bk32s2 bk32s3; do
  SANTA_TRITON_VARIANT=$var timeout 40 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
cd $OUT && tar czf r41.tgz r41 && rm -rf r41
