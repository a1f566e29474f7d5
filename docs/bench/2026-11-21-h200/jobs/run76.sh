#!/bin/bash
# GPU run 76 (session 12): decode table with small SAAP buckets packed (bkt_pack auto); all SAAP and
# SANTA GPU tests first.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r76; mkdir -p $R
timeout 300 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py tests/runtime/santa > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -2 $R/gpu_tests.txt
timeout 200 python3 scripts/bench_decode.py --json $R/bench_decode.json > $R/bench_decode.txt 2>&1
echo "bench rc=$?" >> $R/bench_decode.txt; head -1 $R/bench_decode.txt; grep -E "^(saap|sdpa) " $R/bench_decode.txt; grep -A31 "^targets" $R/bench_decode.txt
cd $OUT && tar czf r76.tgz r76 && rm -rf r76
