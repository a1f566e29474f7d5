#!/bin/bash
# GPU run 70 (session 11): decode table with b2 added by layer 2 and sorted ranking candidates; all SAAP and
# SANTA GPU tests first; the classifier's stages at B = 1 and 8.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r70; mkdir -p $R
timeout 240 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py tests/runtime/santa > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -2 $R/gpu_tests.txt
timeout 200 python3 scripts/bench_decode.py --json $R/bench_decode.json > $R/bench_decode.txt 2>&1
echo "bench rc=$?" >> $R/bench_decode.txt; head -1 $R/bench_decode.txt; grep -E "^(saap|sdpa) " $R/bench_decode.txt; grep -A31 "^targets" $R/bench_decode.txt
for b in 1 8; do timeout 100 python3 scripts/bench_saap_classifier.py --batch $b > $R/cls_b$b.txt 2>&1; done
cd $OUT && tar czf r70.tgz r70 && rm -rf r70
