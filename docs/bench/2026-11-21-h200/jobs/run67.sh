#!/bin/bash
# GPU run 67 (session 11): new defaults (b2 added by layer 2, sorted candidates) against the session-10
# ranking and three more schedules (no candidate filter, 4 ranking warps, layer 1 in one k step); SAAP GPU
# tests of the new defaults first; the classifier's stages at B = 1.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r67; mkdir -p $R
timeout 200 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py > $R/tests.txt 2>&1
echo "rc=$?" >> $R/tests.txt; tail -2 $R/tests.txt
timeout 90 python3 scripts/bench_saap_classifier.py --batch 1 > $R/cls_b1.txt 2>&1; echo "rc=$?" >> $R/cls_b1.txt
grep -iE "layer2|select|rank|rc=" $R/cls_b1.txt | head -40
timeout 250 python3 scripts/bench_decode.py --saap-variants default b2-in-rank-counted nofilter rank-w4 l1-k128 --batches 1 8 --lengths 131072 8192 > $R/saap_variants.txt 2>&1
echo "rc=$?" >> $R/saap_variants.txt; grep -A30 "^SAAP variants" $R/saap_variants.txt
cd $OUT && tar czf r67.tgz r67 && rm -rf r67
