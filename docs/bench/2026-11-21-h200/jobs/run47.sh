#!/bin/bash
# GPU run 47 (session 9): SAAP layer 1 on tensor cores for 16-bit queries at B >= 2: GPU tests, the
# classifier stages at B=8, variants side by side, then the full decode table on these defaults.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r47; mkdir -p $R
timeout 120 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -2 $R/gpu_tests.txt
timeout 60 python3 scripts/bench_saap_classifier.py --batch 8 > $R/cls_b8.txt 2>&1; grep -E "^(layer1|rank|whole)" $R/cls_b8.txt
timeout 120 python3 scripts/bench_decode.py --saap-variants default l1-gemv l1-dot l1-dot-n32 --batches 8 1 --lengths 8192 131072 > $R/saap_l1dot.txt 2>&1
echo "rc=$?" >> $R/saap_l1dot.txt; grep -A18 "^SAAP variants" $R/saap_l1dot.txt
timeout 200 python3 scripts/bench_decode.py --json $R/bench_decode.json > $R/bench_decode.txt 2>&1
echo "bench rc=$?" >> $R/bench_decode.txt; head -1 $R/bench_decode.txt; grep -E "^(saap|sdpa) " $R/bench_decode.txt; grep -A31 "^targets" $R/bench_decode.txt
cd $OUT && tar czf r47.tgz r47 && rm -rf r47
