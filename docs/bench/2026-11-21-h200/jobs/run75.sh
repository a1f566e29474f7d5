#!/bin/bash
# GPU run 75 (session 12): SAAP small buckets packed (bkt_pack: several selected buckets per program as one key
# list). GPU tests of the packed path and the SAAP defaults, then the step side by side at l = 64 and l = 32.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r75; mkdir -p $R
timeout 200 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py -k "packed or matches" > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -2 $R/gpu_tests.txt
timeout 170 python3 scripts/bench_decode.py --saap-variants default pack2 pack4 pack8 pack16 --top-l 64 --batches 8 1 --lengths 8192 32768 > $R/variants_l64.txt 2>&1
echo "rc=$?" >> $R/variants_l64.txt; grep -A24 "^SAAP variants" $R/variants_l64.txt
timeout 200 python3 scripts/bench_decode.py --saap-variants default pack4 pack8 --top-l 32 --batches 8 1 --lengths 8192 32768 131072 > $R/variants_l32.txt 2>&1
echo "rc=$?" >> $R/variants_l32.txt; grep -A24 "^SAAP variants" $R/variants_l32.txt
cd $OUT && tar czf r75.tgz r75 && rm -rf r75
