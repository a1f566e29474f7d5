#!/bin/bash
# GPU run 50 (session 9): SAAP merge in fewer, wider partial steps.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r50; mkdir -p $R
timeout 150 python3 scripts/bench_decode.py --saap-variants default merge-p64 merge-p64-d16 merge-p32 merge-p64-d64 --batches 8 1 --lengths 8192 131072 > $R/saap_merge.txt 2>&1
echo "rc=$?" >> $R/saap_merge.txt; grep -A22 "^SAAP variants" $R/saap_merge.txt
cd $OUT && tar czf r50.tgz r50 && rm -rf r50
