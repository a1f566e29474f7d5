#!/bin/bash
# GPU run 64 (session 11): layer 2's w2 tiles by TMA; the ranking done by layer 2's last program per KV head
# (arrival counter, no ranking launch); sorted vs counted candidates. GPU tests of SAAP first.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r64; mkdir -p $R
timeout 200 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py > $R/tests.txt 2>&1
echo "rc=$?" >> $R/tests.txt; tail -3 $R/tests.txt
timeout 90 python3 scripts/bench_saap_classifier.py --batch 1 > $R/cls_b1.txt 2>&1; echo "rc=$?" >> $R/cls_b1.txt
grep -iE "layer2|select|rank \(|rc=" $R/cls_b1.txt | head -20
timeout 280 python3 scripts/bench_decode.py --saap-variants default sorted tma rank-l2 rank-l2-sorted rank-l2-tma rank-l2-tma-sorted tma-s3 --batches 1 8 --lengths 131072 8192 > $R/saap_variants.txt 2>&1
echo "rc=$?" >> $R/saap_variants.txt; grep -A40 "^SAAP variants" $R/saap_variants.txt
cd $OUT && tar czf r64.tgz r64 && rm -rf r64
