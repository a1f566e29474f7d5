#!/bin/bash
# GPU run 31 (session 8): SAAP window on a side stream under the classifier (overlap_window) with the bmm
# classifier and win_programs, two rounds per variant.
cd "$(dirname "$0")/../.." || exit 1
python3 scripts/bench_decode.py --saap-variants default overlap --batches 1 8 --lengths 8192 131072 > $OUT/var.txt 2>&1
grep -A8 "^SAAP variants" $OUT/var.txt
