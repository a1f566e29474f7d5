#!/bin/bash
# GPU run 91 (session 14): SANTA-flash stream kernel with the chunked lookup from 128 tiles (32k at tile 256;
# the new default) vs the whole-tile lookup everywhere (fwhole), graphed in own processes; all SAAP and
# SANTA GPU tests on the default; then the full decode table.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r91; mkdir -p $R
timeout 300 python3 -m pytest -q -m gpu tests/runtime/saap/test_saap_triton.py tests/runtime/santa > $R/gpu_tests.txt 2>&1
echo "gpu tests rc=$?" >> $R/gpu_tests.txt; tail -2 $R/gpu_tests.txt
for var in default fwhole default fwhole; do
  SANTA_TRITON_VARIANT=$var timeout 120 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 131072 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-flash" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
timeout 250 python3 scripts/bench_decode.py --json $R/bench_decode.json > $R/bench_decode.txt 2>&1
echo "bench rc=$?" >> $R/bench_decode.txt; head -1 $R/bench_decode.txt; grep -E "^(santa|sdpa) " $R/bench_decode.txt; grep -A31 "^targets" $R/bench_decode.txt
cd $OUT && tar czf r91.tgz r91 && rm -rf r91
