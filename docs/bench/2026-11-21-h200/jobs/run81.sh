#!/bin/bash
# GPU run 81 (session 13): SANTA-prop gather: samples located by int64 thresholds (th), x tiles per program
# x register cap x samples per step; GPU tests on th_gt2; gather stage alone, then graphed.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r81; mkdir -p $R
SANTA_TRITON_VARIANT=th_gt2 timeout 150 python3 -m pytest -q -m gpu tests/runtime/santa/test_santa_triton.py -k "counts_and_output or converges or poison" > $R/gpu_tests_th_gt2.txt 2>&1
echo "gpu tests th_gt2 rc=$?" >> $R/gpu_tests_th_gt2.txt; tail -2 $R/gpu_tests_th_gt2.txt
timeout 150 python3 scripts/bench_santa_stages.py --tilings prop --batches 1 8 --lengths 32768 --variants default gt2 th th_gt2 th_gt2s2 gt2s2 gt2r80 th_gt2r80 > $R/stages.txt 2>&1
echo "stages rc=$?" >> $R/stages.txt; grep -E "gather|rc=" $R/stages.txt
for var in ${SANTA_VARS:-default gt2 th th_gt2 th_gt2s2 th_gt2r80 default}; do
  SANTA_TRITON_VARIANT=$var timeout 60 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-prop" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
cd $OUT && tar czf r81.tgz r81 && rm -rf r81
