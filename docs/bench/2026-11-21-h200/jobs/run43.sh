#!/bin/bash
# GPU run 43 (session 9): SAAP schedule variants at B=8 8k (the window beside the classifier in few long
# programs; layer-1 tile width; buckets per program) and B=1 / B=8 128k.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r43; mkdir -p $R
timeout 200 python3 scripts/bench_decode.py --saap-variants default overlap overlap-winp64 overlap-winp128 overlap-winp64-per4 bkt-per4 l1n32 l1n16 --batches 8 1 --lengths 8192 131072 > $R/saap_variants.txt 2>&1
echo "rc=$?" >> $R/saap_variants.txt; tail -20 $R/saap_variants.txt
cd $OUT && tar czf r43.tgz r43 && rm -rf r43
