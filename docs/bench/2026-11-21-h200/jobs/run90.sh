#!/bin/bash
# GPU run 90 (session 14): SANTA-flash hybrid stream kernel, chunk sums from the re-read tile (tail), tiles with <= 16 / 8 samples
# per head take the chunked lookup, denser ones the whole-tile one); GPU tests on fch16, graphed variants.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r90; mkdir -p $R
SANTA_TRITON_VARIANT=fch16 timeout 150 python3 -m pytest -q -m gpu tests/runtime/santa > $R/gpu_tests_fch16.txt 2>&1
echo "gpu tests fch16 rc=$?" >> $R/gpu_tests_fch16.txt; tail -2 $R/gpu_tests_fch16.txt
for var in default fch16 fch_s8 default fch16; do
  SANTA_TRITON_VARIANT=$var timeout 120 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 131072 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-flash" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
cd $OUT && tar czf r90.tgz r90 && rm -rf r90
