#!/bin/bash
# GPU run 60 (session 10): the window on a side stream, the bucket partials alone in 128-key steps.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r60; mkdir -p $R
timeout 300 python3 scripts/bench_decode.py --saap-variants default ov-bkt64 ov-bkt128 ov-bkt128-pv ov-bkt128-w8 --batches 1 8 --lengths 131072 8192 > $R/saap_ovbkt.txt 2>&1
echo "rc=$?" >> $R/saap_ovbkt.txt; grep -A24 "^SAAP variants" $R/saap_ovbkt.txt
SAAP_TRITON_CONFIG="overlap_window=1,bkt_block_n=128" timeout 200 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py -k "matches_reference or graph" > $R/tests.txt 2>&1
echo "rc=$?" >> $R/tests.txt; tail -2 $R/tests.txt
cd $OUT && tar czf r60.tgz r60 && rm -rf r60
