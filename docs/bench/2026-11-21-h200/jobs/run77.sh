#!/bin/bash
# GPU run 77 (session 12): SAAP 128k B=1 (0.9 us short of 3x the floor): the classifier's remaining tile shapes
# (layer 2 256-column tiles, 4 / 8 warps, 3 / 5 stages; layer 1 128-unit slices, one k step), side by side.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r77; mkdir -p $R
timeout 280 python3 scripts/bench_decode.py --saap-variants default l2n256 l2n256-w8 l2s5 l2s3 l1n128 l1n128-k128 l1-dot-n32 default --batches 1 --lengths 131072 8192 > $R/variants.txt 2>&1
echo "rc=$?" >> $R/variants.txt; grep -A24 "^SAAP variants" $R/variants.txt
cd $OUT && tar czf r77.tgz r77 && rm -rf r77
