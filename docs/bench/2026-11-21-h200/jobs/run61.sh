#!/bin/bash
# GPU run 61 (session 10): layer 1's epilogue vectors (bias, batch-norm) requested before its k loop.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r61; mkdir -p $R
timeout 300 python3 scripts/bench_decode.py --saap-variants default l1-early l1-early-n32 l1-early-n128 --batches 1 8 --lengths 131072 8192 > $R/saap_l1early.txt 2>&1
echo "rc=$?" >> $R/saap_l1early.txt; grep -A18 "^SAAP variants" $R/saap_l1early.txt
SAAP_TRITON_CONFIG="l1_early_vec=1" timeout 200 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py -k "bf16_classifier or graph" > $R/tests.txt 2>&1
echo "rc=$?" >> $R/tests.txt; tail -2 $R/tests.txt
cd $OUT && tar czf r61.tgz r61 && rm -rf r61
