#!/bin/bash
# GPU run 84 (session 13): SANTA-prop budgets computed by each head's last score program (bi: no budget
# launch), with the gather variants; all SANTA GPU tests on bi_th_gt2s2.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r84; mkdir -p $R
SANTA_TRITON_VARIANT=bi_th_gt2s2 timeout 200 python3 -m pytest -q -m gpu tests/runtime/santa > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -3 $R/gpu_tests.txt
for var in ${SANTA_VARS:-default bi gt2 bi_gt2 th_gt2s2 bi_th_gt2s2 default}; do
  SANTA_TRITON_VARIANT=$var timeout 60 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-prop" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
cd $OUT && tar czf r84.tgz r84 && rm -rf r84
