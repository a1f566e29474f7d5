#!/bin/bash
# GPU run 93 (session 14): SANTA-flash merge launch shapes (partials per load step, output columns per
# program; never tuned before), graphed in own processes; SANTA GPU tests on mc32c16.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r93; mkdir -p $R
SANTA_TRITON_VARIANT=mc32c16 timeout 150 python3 -m pytest -q -m gpu tests/runtime/santa > $R/gpu_tests_mc32c16.txt 2>&1
echo "gpu tests mc32c16 rc=$?" >> $R/gpu_tests_mc32c16.txt; tail -2 $R/gpu_tests_mc32c16.txt
for var in default mc32 mc8 mcols16 mcols64 mc32c16 default mc32c16; do
  SANTA_TRITON_VARIANT=$var timeout 60 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-flash" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
cd $OUT && tar czf r93.tgz r93 && rm -rf r93
