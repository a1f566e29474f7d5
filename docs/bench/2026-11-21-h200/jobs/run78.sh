#!/bin/bash
# GPU run 78 (session 13): SANTA-prop gather occupancy (96 regs at 2 warps: ~10 programs per SM) and
# several tiles per program, stage by stage and graphed; SAAP 128k B=1 bucket-chain variants re-timed.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r78; mkdir -p $R
for var in default gw4 gt4; do
  SANTA_TRITON_VARIANT=$var timeout 150 python3 -m pytest -q -m gpu tests/runtime/santa/test_santa_triton.py -k "counts_and_output or converges or poison" > $R/gpu_tests_$var.txt 2>&1
  echo "gpu tests $var rc=$?" >> $R/gpu_tests_$var.txt; tail -2 $R/gpu_tests_$var.txt
done
timeout 200 python3 scripts/bench_santa_stages.py --tilings prop --batches 1 8 --lengths 8192 32768 --variants default gw4 gr64 gw4r64 gw1 gt2 gt4 gt4w1 gt8w1 gt4s8 > $R/stages.txt 2>&1
echo "stages rc=$?" >> $R/stages.txt; grep -E "gather|full|rc=" $R/stages.txt
cd $OUT && tar czf r78.tgz r78 && rm -rf r78
