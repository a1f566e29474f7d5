#!/bin/bash
# GPU run 94 (session 14): SANTA-flash merge launch, more partials per load step at 16 columns per program,
# graphed in own processes at every length.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r94; mkdir -p $R
for var in default mc32c16 mc64c16 mc128c16 default mc32c16 mc64c16; do
  SANTA_TRITON_VARIANT=$var timeout 90 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 131072 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-flash" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
cd $OUT && tar czf r94.tgz r94 && rm -rf r94
