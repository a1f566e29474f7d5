#!/bin/bash
# GPU run 44 (session 9): the final decode table on this session's defaults, and the same with flash
# resolving 32 samples per step (fmaxs32); GPU tests on both.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r44; mkdir -p $R
timeout 170 python3 -m pytest -q -m gpu tests/runtime/santa/test_santa_triton.py tests/runtime/saap/test_saap_triton.py > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -2 $R/gpu_tests.txt
SANTA_TRITON_VARIANT=fmaxs32 timeout 90 python3 -m pytest -q -m gpu tests/runtime/santa/test_santa_triton.py > $R/gpu_tests_fmaxs32.txt 2>&1
echo "gpu tests fmaxs32 rc=$?" >> $R/gpu_tests_fmaxs32.txt; tail -2 $R/gpu_tests_fmaxs32.txt
timeout 200 python3 scripts/bench_decode.py --json $R/bench_decode.json > $R/bench_decode.txt 2>&1
echo "bench rc=$?" >> $R/bench_decode.txt; grep -A40 "^targets" $R/bench_decode.txt
SANTA_TRITON_VARIANT=fmaxs32 timeout 120 python3 scripts/bench_decode.py --methods santa --json $R/bench_santa_fmaxs32.json > $R/bench_santa_fmaxs32.txt 2>&1
echo "bench fmaxs32 rc=$?" >> $R/bench_santa_fmaxs32.txt; grep -E "^santa-" $R/bench_santa_fmaxs32.txt | awk '{print $1,$2,$4,$5,$7,$12}'
echo; grep -E "^santa-" $R/bench_decode.txt | awk '{print $1,$2,$4,$5,$7,$12}'
cd $OUT && tar czf r44.tgz r44 && rm -rf r44
