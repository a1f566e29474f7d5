#!/bin/bash
# GPU run 53 (session 10): SAAP layer 1 asks L2 for part of w2 (bulk prefetch) so the bmm finds it there.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r53; mkdir -p $R
timeout 150 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py -k "prefetch or bf16_classifier or graph" > $R/tests.txt 2>&1
echo "rc=$?" >> $R/tests.txt; tail -3 $R/tests.txt
timeout 300 python3 scripts/bench_decode.py --saap-variants default pf25 pf40 pf60 pf80 pf100 --batches 1 8 --lengths 131072 8192 > $R/saap_pf.txt 2>&1
echo "rc=$?" >> $R/saap_pf.txt; grep -A30 "^SAAP variants" $R/saap_pf.txt
cd $OUT && tar czf r53.tgz r53 && rm -rf r53
