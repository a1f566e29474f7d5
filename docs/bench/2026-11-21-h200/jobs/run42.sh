#!/bin/bash
# GPU run 42 (session 9): GPU tests on the new defaults (SANTA 32-key chunks x 4 at 2 warps; SAAP layer 1
# unrolled), classifier stages at B=1/8 with and without the unroll, then the full decode table.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r42; mkdir -p $R
timeout 200 python3 -m pytest -q -m gpu tests/runtime/santa/test_santa_triton.py tests/runtime/saap/test_saap_triton.py -x > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -3 $R/gpu_tests.txt
for b in 1 8; do for u in 1 0; do
  SAAP_TRITON_CONFIG="gemv1_unroll=$u" timeout 60 python3 scripts/bench_saap_classifier.py --batch $b > $R/cls_b${b}_u$u.txt 2>&1
  echo "== B=$b unroll=$u rc=$?"; grep -E "^(layer1 gemv|layer1 \+|whole select \(|rank)" $R/cls_b${b}_u$u.txt
done; done
timeout 280 python3 scripts/bench_decode.py --json $R/bench_decode.json > $R/bench_decode.txt 2>&1
echo "bench rc=$?" >> $R/bench_decode.txt; tail -75 $R/bench_decode.txt
cd $OUT && tar czf r42.tgz r42 && rm -rf r42
