#!/bin/bash
# GPU run 30 (session 8): bench with two captures per graphed timing (and two rounds of variants): the ABAB
# check of run 29 again, then the full decode table for the README.
cd "$(dirname "$0")/../.." || exit 1
python3 scripts/bench_decode.py --saap-variants winp0 default --batches 8 --lengths 8192 131072 > $OUT/var.txt 2>&1
python3 scripts/bench_decode.py --json $OUT/bench_decode.json > $OUT/table.txt 2>&1
grep -A8 "^SAAP variants" $OUT/var.txt; head -1 $OUT/table.txt; grep -A12 "^targets" $OUT/table.txt
