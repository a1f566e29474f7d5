#!/bin/bash
# GPU run 73 (session 12): layers 1 and 2 in one launch behind per-head arrival counters (l12_flags): GPU classifier tests,
# classifier stages at B = 1 and 8, then the whole step side by side with the default (two rounds).
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r73; mkdir -p $R
timeout 200 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py -k "classifier or graph or matches" > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -2 $R/gpu_tests.txt
for b in 1 8; do timeout 100 python3 scripts/bench_saap_classifier.py --batch $b > $R/cls_b$b.txt 2>&1; grep -E "layer1|one launch|whole select \(default\)" $R/cls_b$b.txt; done
timeout 240 python3 scripts/bench_decode.py --saap-variants default l12f l12f-n128 l12f-n32 l12f-s3 default > $R/variants.txt 2>&1
echo "variants rc=$?" >> $R/variants.txt; grep -A40 "^SAAP variants" $R/variants.txt
cd $OUT && tar czf r73.tgz r73 && rm -rf r73
