#!/bin/bash
# GPU run 88 (session 14): SANTA-flash stream kernel with the chunked sample lookup (flash_chunks: chunk
# statistics kept in registers, one 32-key chunk of the stored scores read per sample), 16 / 8 / 4
# samples per step; GPU tests on fch_s8, then graphed variants each in its own process.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r88; mkdir -p $R
for var in fch_s8 fch; do
  SANTA_TRITON_VARIANT=$var timeout 150 python3 -m pytest -q -m gpu tests/runtime/santa > $R/gpu_tests_$var.txt 2>&1
  echo "gpu tests $var rc=$?" >> $R/gpu_tests_$var.txt; tail -2 $R/gpu_tests_$var.txt
done
for var in ${SANTA_VARS:-default fch fch_s8 fch_s4 default fch_s8}; do
  SANTA_TRITON_VARIANT=$var timeout 60 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-flash" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
cd $OUT && tar czf r88.tgz r88 && rm -rf r88
