#!/bin/bash
# GPU run 52 (session 9): SAAP window tile length and key step on the new merge.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r52; mkdir -p $R
timeout 120 python3 scripts/bench_decode.py --saap-variants default winsteps4 winsteps8 bn128 --batches 1 8 --lengths 131072 8192 > $R/saap_win.txt 2>&1
echo "rc=$?" >> $R/saap_win.txt; grep -A18 "^SAAP variants" $R/saap_win.txt
cd $OUT && tar czf r52.tgz r52 && rm -rf r52
