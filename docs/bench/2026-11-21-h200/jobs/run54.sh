#!/bin/bash
# GPU run 54 (session 10): SAAP layer 2 as a Triton w2 stream (three terms summed in its epilogue) vs cuBLAS bmm.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r54; mkdir -p $R
timeout 150 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py -k "bf16_classifier or graph" > $R/tests.txt 2>&1
echo "rc=$?" >> $R/tests.txt; tail -3 $R/tests.txt
for b in 1 8; do timeout 100 python3 scripts/bench_saap_classifier.py --batch $b > $R/cls_b$b.txt 2>&1; grep -i "triton\|bmm 3\|sum of\|whole\|rank (3" $R/cls_b$b.txt; done
timeout 300 python3 scripts/bench_decode.py --saap-variants default l2t l2t-s6 l2t-n128 l2t-k128 l2t-n32 l2t-w8-n128 --batches 1 8 --lengths 131072 8192 > $R/saap_l2t.txt 2>&1
echo "rc=$?" >> $R/saap_l2t.txt; grep -A30 "^SAAP variants" $R/saap_l2t.txt
cd $OUT && tar czf r54.tgz r54 && rm -rf r54
