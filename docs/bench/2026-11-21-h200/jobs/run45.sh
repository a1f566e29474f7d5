#!/bin/bash
# GPU run 45 (session 9): SAAP attention schedules re-measured on the current classifier (V loaded with
# K, buckets split over two programs, 32-key steps, 8 warps, 3 stages) at 128k B=1 and 8k B=8.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r45; mkdir -p $R
timeout 100 python3 scripts/bench_decode.py --saap-variants default prefetch-v bkt-split2 split2-pv attn-bn32 attn-w8 s3 --batches 1 --lengths 131072 > $R/saap_attn_b1.txt 2>&1
echo "rc=$?" >> $R/saap_attn_b1.txt; grep -A12 "^SAAP variants" $R/saap_attn_b1.txt
timeout 100 python3 scripts/bench_decode.py --saap-variants default prefetch-v bkt-split2 split2-pv attn-bn32 attn-w8 s3 --batches 8 --lengths 8192 > $R/saap_attn_b8.txt 2>&1
echo "rc=$?" >> $R/saap_attn_b8.txt; grep -A12 "^SAAP variants" $R/saap_attn_b8.txt
cd $OUT && tar czf r45.tgz r45 && rm -rf r45
