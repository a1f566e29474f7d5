#!/bin/bash
# GPU run 99 (session 15): SANTA-flash stream kernel at 8k, the tile scores kept in registers (flash_keep_scores)
# instead of stored and re-read; own processes, graphed.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r99; mkdir -p $R
for var in default keep keep_s3 keep_m8 keep_m32 default keep; do
  SANTA_TRITON_VARIANT=$var timeout 100 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-flash|^sdpa" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
SANTA_TRITON_VARIANT=keep timeout 200 python3 -m pytest -q -m gpu tests/runtime/santa/test_santa_triton.py -k "flash" > $R/tests_keep.txt 2>&1
echo "tests rc=$?"; tail -3 $R/tests_keep.txt
cd $OUT && tar czf r99.tgz r99 && rm -rf r99
