#!/bin/bash
# GPU run 100 (session 15): SANTA-prop budgets + gather as one program per query head (prop_head_rows) vs the
# budget and gather launches; own processes, graphed, every length. Then the SANTA GPU tests under ph256.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r100; mkdir -p $R
for var in default ph32 ph32s32 ph32t1k ph256 ph256s32 default ph32; do
  SANTA_TRITON_VARIANT=$var timeout 120 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 131072 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-prop|^sdpa" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
SANTA_TRITON_VARIANT=ph256 timeout 200 python3 -m pytest -q -m gpu tests/runtime/santa/test_santa_triton.py > $R/tests_ph256.txt 2>&1
echo "tests rc=$?"; tail -3 $R/tests_ph256.txt
cd $OUT && tar czf r100.tgz r100 && rm -rf r100
