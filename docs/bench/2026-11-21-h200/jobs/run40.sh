#!/bin/bash
# GPU run 40 (session 9): GPU tests (SANTA at 2 warps now the default; SAAP prefetching layer 2), SAAP
# classifier variants, SANTA flash variants at B=8.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r40; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > $R/gpu.txt 2>&1
timeout 240 python3 -m pytest -q -m gpu tests/runtime/santa/test_santa_triton.py tests/runtime/saap/test_saap_triton.py -x > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -5 $R/gpu_tests.txt
timeout 150 python3 scripts/bench_decode.py --saap-variants default pre-k512-n64 pre-k256-n64-w4 pre-k256-n128 pre-k1024-n32 pre-k512-n64-w4 pre-nopdl --batches 1 8 --lengths 8192 131072 > $R/saap_pre.txt 2>&1
echo "saap rc=$?" >> $R/saap_pre.txt; tail -22 $R/saap_pre.txt
for var in default w1 streamdot; do
  SANTA_TRITON_VARIANT=$var timeout 40 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
cd $OUT && tar czf r40.tgz r40 && rm -rf r40
