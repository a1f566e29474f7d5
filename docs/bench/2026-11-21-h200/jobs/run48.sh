#!/bin/bash
# GPU run 48 (session 9): the final decode table on this session's defaults (SAAP layer 1 on tensor cores
# at every batch for 16-bit queries), GPU tests of SAAP and SANTA first.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r48; mkdir -p $R
timeout 170 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py tests/runtime/santa/test_santa_triton.py > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -2 $R/gpu_tests.txt
timeout 200 python3 scripts/bench_decode.py --json $R/bench_decode.json > $R/bench_decode.txt 2>&1
echo "bench rc=$?" >> $R/bench_decode.txt; head -1 $R/bench_decode.txt; grep -A31 "^targets" $R/bench_decode.txt
cd $OUT && tar czf r48.tgz r48 && rm -rf r48
