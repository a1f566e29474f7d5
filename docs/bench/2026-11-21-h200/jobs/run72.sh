#!/bin/bash
# GPU run 72 (session 12): layer 1 recomputed inside the Triton layer 2 (l2_fuse_l1): GPU classifier tests,
# classifier stages at B = 1 and 8, then the whole step side by side with the default (two rounds).
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r72; mkdir -p $R
timeout 150 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py -k "classifier or graph" > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -2 $R/gpu_tests.txt
for b in 1 8; do timeout 100 python3 scripts/bench_saap_classifier.py --batch $b > $R/cls_b$b.txt 2>&1; grep -E "layer1|fused|whole select \(default\)" $R/cls_b$b.txt; done
timeout 240 python3 scripts/bench_decode.py --saap-variants default l12 l12-n256 l12-n64 l12-s3 l12-k32 > $R/variants.txt 2>&1
echo "variants rc=$?" >> $R/variants.txt; grep -A40 "^SAAP variants" $R/variants.txt
cd $OUT && tar czf r72.tgz r72 && rm -rf r72
