#!/bin/bash
# GPU run 56 (session 10): the ranking's threshold from 2 / 4 x K_PAD chunk maxima, candidates placed by counting,
# with and without the Triton layer 2.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r56; mkdir -p $R
timeout 150 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py -k "bf16_classifier" > $R/tests.txt 2>&1
echo "rc=$?" >> $R/tests.txt; tail -3 $R/tests.txt
for b in 1 8; do timeout 100 python3 scripts/bench_saap_classifier.py --batch $b > $R/cls_b$b.txt 2>&1; grep -i "candidates\|rank" $R/cls_b$b.txt; done
timeout 300 python3 scripts/bench_decode.py --saap-variants default l2t-n128 count-ch2 count-ch4 l2t-n128-count l2t-n128-count-ch2 l2t-n128-count-ch4 l2t-n128-count-ch4-w4 --batches 1 8 --lengths 131072 8192 > $R/saap_rank.txt 2>&1
echo "rc=$?" >> $R/saap_rank.txt; grep -A34 "^SAAP variants" $R/saap_rank.txt
cd $OUT && tar czf r56.tgz r56 && rm -rf r56
