#!/bin/bash
# GPU run 63 (session 10): the ranking writes the chosen buckets' slot ranges (one dependent load less per bucket
# program) vs the id lookup; GPU tests of SAAP first.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r63; mkdir -p $R
timeout 200 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py > $R/tests.txt 2>&1
echo "rc=$?" >> $R/tests.txt; tail -2 $R/tests.txt
timeout 300 python3 scripts/bench_decode.py --saap-variants default no-ranges ranges-sorted --batches 1 8 --lengths 131072 8192 > $R/saap_ranges.txt 2>&1
echo "rc=$?" >> $R/saap_ranges.txt; grep -A14 "^SAAP variants" $R/saap_ranges.txt
cd $OUT && tar czf r63.tgz r63 && rm -rf r63
