#!/bin/bash
# GPU run 92 (session 14): after the device-code refactor (shared helpers for the online chunk statistics,
# flash's tile budget and partial store): SANTA GPU tests and graphed SANTA times at every shape.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r92; mkdir -p $R
timeout 200 python3 -m pytest -q -m gpu tests/runtime/santa > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -2 $R/gpu_tests.txt
timeout 150 python3 scripts/bench_decode.py --methods santa > $R/santa.txt 2>&1
echo "bench rc=$?" >> $R/santa.txt; grep -E "^santa|rc=" $R/santa.txt | awk '{print $1,$2,$4,$5,$7,$12}'
cd $OUT && tar czf r92.tgz r92 && rm -rf r92
