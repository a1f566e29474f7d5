#!/bin/bash
# GPU run 96 (session 14): decode table with the flash merge at 16 columns x 128 partials per step (new default);
# all SAAP and SANTA GPU tests first.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r96; mkdir -p $R
timeout 300 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py tests/runtime/santa > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -2 $R/gpu_tests.txt
timeout 250 python3 scripts/bench_decode.py --json $R/bench_decode.json > $R/bench_decode.txt 2>&1
echo "bench rc=$?" >> $R/bench_decode.txt; head -1 $R/bench_decode.txt; grep -E "^(santa-prop|sdpa) " $R/bench_decode.txt; grep -A31 "^targets" $R/bench_decode.txt
cd $OUT && tar czf r96.tgz r96 && rm -rf r96
