#!/bin/bash
# GPU run 68 (session 11): the ranking prefetching the bucket index's slot_start / bucket_count rows into L2
# (inline prefetch.global.L2), with and without V loaded beside K; the side-stream window and bucket splits
# re-timed on the new classifier. SAAP GPU tests first.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r68; mkdir -p $R
timeout 200 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py > $R/tests.txt 2>&1
echo "rc=$?" >> $R/tests.txt; tail -2 $R/tests.txt
timeout 300 python3 scripts/bench_decode.py --saap-variants default idx-pf idx-pf-pv prefetch-v overlap bkt-split2 --batches 1 8 --lengths 131072 8192 > $R/saap_variants.txt 2>&1
echo "rc=$?" >> $R/saap_variants.txt; grep -A30 "^SAAP variants" $R/saap_variants.txt
cd $OUT && tar czf r68.tgz r68 && rm -rf r68
