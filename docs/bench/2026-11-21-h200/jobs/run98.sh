#!/bin/bash
# GPU run 98 (session 15): SANTA-flash stream kernel at 8k (whole-tile lookup), counts @ V in key chunks
# (flash_values=chunkdot) vs the per-sample row gather, several chunk sizes / pipeline depths; own processes, graphed.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r98; mkdir -p $R
for var in default cdot cdot_s1 cdot_s3 cdot_b16 cdot_b16s4 cdot_b64s1 default cdot; do
  SANTA_TRITON_VARIANT=$var timeout 100 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-flash|^sdpa" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
SANTA_TRITON_VARIANT=cdot timeout 200 python3 -m pytest -q -m gpu tests/runtime/santa/test_santa_triton.py -k "flash" > $R/tests_cdot.txt 2>&1
echo "tests rc=$?"; tail -3 $R/tests_cdot.txt
cd $OUT && tar czf r98.tgz r98 && rm -rf r98
