#!/bin/bash
# GPU run 55 (session 10): Triton layer 2 chained to layer 1 by PDL (w2 tiles requested before the wait), and
# the ranking's candidates placed by counting instead of a bitonic sort.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r55; mkdir -p $R
timeout 150 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py -k "bf16_classifier or graph" > $R/tests.txt 2>&1
echo "rc=$?" >> $R/tests.txt; tail -3 $R/tests.txt
for b in 1 8; do timeout 100 python3 scripts/bench_saap_classifier.py --batch $b > $R/cls_b$b.txt 2>&1; grep -i "triton\|candidates\|rank\|whole" $R/cls_b$b.txt; done
timeout 300 python3 scripts/bench_decode.py --saap-variants default l2t-n128 l2t-n128-pdl1 l2t-n128-pdl2 l2t-pdl2 rank-count l2t-n128-count l2t-n128-pdl2-count --batches 1 8 --lengths 131072 8192 > $R/saap_pdl.txt 2>&1
echo "rc=$?" >> $R/saap_pdl.txt; grep -A34 "^SAAP variants" $R/saap_pdl.txt
cd $OUT && tar czf r55.tgz r55 && rm -rf r55
