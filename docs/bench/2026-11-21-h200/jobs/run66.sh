#!/bin/bash
# GPU run 66 (session 11): b2 added by layer 2 (its DRAM load hidden under the w2 stream) and the ranking's
# softmax normalizers from layer 2's per-tile statistics; sorted vs counted candidates. SAAP GPU tests first.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r66; mkdir -p $R
timeout 200 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py > $R/tests.txt 2>&1
echo "rc=$?" >> $R/tests.txt; tail -3 $R/tests.txt
timeout 90 python3 scripts/bench_saap_classifier.py --batch 1 > $R/cls_b1.txt 2>&1; echo "rc=$?" >> $R/cls_b1.txt
grep -iE "layer2|select|rank|rc=" $R/cls_b1.txt | head -40
timeout 250 python3 scripts/bench_decode.py --saap-variants default sorted l2-bias l2-bias-sorted l2-stats l2-stats-sorted --batches 1 8 --lengths 131072 8192 > $R/saap_variants.txt 2>&1
echo "rc=$?" >> $R/saap_variants.txt; grep -A30 "^SAAP variants" $R/saap_variants.txt
cd $OUT && tar czf r66.tgz r66 && rm -rf r66
