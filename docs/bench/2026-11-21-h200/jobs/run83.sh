#!/bin/bash
# GPU run 83 (session 13): SANTA K chunks without per-element masks (even: keys past the length clamped),
# alone and with the threshold gather over 2 tiles x 2 samples; all SANTA GPU tests on even_th_gt2s2.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r83; mkdir -p $R
SANTA_TRITON_VARIANT=even_th_gt2s2 timeout 200 python3 -m pytest -q -m gpu tests/runtime/santa > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -3 $R/gpu_tests.txt
for var in ${SANTA_VARS:-default even even_th_gt2s2 th_gt2s2 even default}; do
  SANTA_TRITON_VARIANT=$var timeout 60 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
cd $OUT && tar czf r83.tgz r83 && rm -rf r83
