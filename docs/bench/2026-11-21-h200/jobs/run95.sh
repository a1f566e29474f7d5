#!/bin/bash
# GPU run 95 (session 14): SANTA-flash merge launch, 128-256 partials per step, 8 or 16 columns per program,
# graphed in own processes at every length.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r95; mkdir -p $R
for var in mc128c16 mc256c16 mc128c8 mc64c8 mc128c16 mc128c8; do
  SANTA_TRITON_VARIANT=$var timeout 90 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 131072 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-flash" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
cd $OUT && tar czf r95.tgz r95 && rm -rf r95
