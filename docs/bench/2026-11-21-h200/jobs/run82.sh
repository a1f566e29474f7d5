#!/bin/bash
# GPU run 82 (session 13): SANTA-prop in batch-row chunks (budgets + gather of chunk i on a side stream
# beside chunk i+1's score pass), with and without the gather variants; GPU tests of the chunked path.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r82; mkdir -p $R
timeout 150 python3 -m pytest -q -m gpu tests/runtime/santa/test_santa_triton.py -k "chunks or programmatic" > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -3 $R/gpu_tests.txt
for var in ${SANTA_VARS:-default ch2 ch4 ch2_gt2s2 ch2_th_gt2s2 ch4_th_gt2s2 th_gt2s2 default}; do
  SANTA_TRITON_VARIANT=$var timeout 60 python3 scripts/bench_decode.py --methods santa --batches 8 --lengths 8192 32768 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-prop" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
cd $OUT && tar czf r82.tgz r82 && rm -rf r82
