#!/bin/bash
# GPU run 29 (session 8): is the first-variant bias gone with the discarded warm-up timing? ABAB order.
cd "$(dirname "$0")/../.." || exit 1
python3 scripts/bench_decode.py --saap-variants winp0 default winp0 default --batches 8 --lengths 8192 131072 2>&1 | grep -A12 "^SAAP variants"
