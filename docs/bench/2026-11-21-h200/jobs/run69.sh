#!/bin/bash
# GPU run 69 (session 11): no ranking launch at small batches: each bucket program of the attention launch
# ranks its (batch, KV head) from the logits itself. SAAP GPU tests first.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r69; mkdir -p $R
timeout 200 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py > $R/tests.txt 2>&1
echo "rc=$?" >> $R/tests.txt; tail -2 $R/tests.txt
timeout 250 python3 scripts/bench_decode.py --saap-variants default rank-in-attn rank-in-attn-nofilter rank-in-attn-counted --batches 1 2 8 --lengths 131072 8192 > $R/saap_variants.txt 2>&1
echo "rc=$?" >> $R/saap_variants.txt; grep -A30 "^SAAP variants" $R/saap_variants.txt
cd $OUT && tar czf r69.tgz r69 && rm -rf r69
