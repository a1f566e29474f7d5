#!/bin/bash
# GPU run 57 (session 10): the one-launch split-K classifier (layer-1 slice + its share of the logits per program).
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r57; mkdir -p $R
timeout 200 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py -k "bf16_classifier" > $R/tests.txt 2>&1
echo "rc=$?" >> $R/tests.txt; tail -3 $R/tests.txt
timeout 330 python3 scripts/bench_decode.py --saap-variants default l2t-n128-count-ch2 splitk splitk-h64 splitk-n128 splitk-s6 splitk-w8 splitk-h64-n128 splitk-count-ch2 --batches 1 8 --lengths 131072 8192 > $R/saap_splitk.txt 2>&1
echo "rc=$?" >> $R/saap_splitk.txt; grep -A40 "^SAAP variants" $R/saap_splitk.txt
cd $OUT && tar czf r57.tgz r57 && rm -rf r57
