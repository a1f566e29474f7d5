#!/bin/bash
# GPU run 32 (session 8): SANTA launch variants (flash's sampling epilogue and K chunking) at B=1/8, 8k/32k,
# each in its own process, graphed times (two captures each).
cd "$(dirname "$0")/../.." || exit 1
for var in default stream_bk32 maxs8 maxs32 w2 bk128; do
  SANTA_TRITON_VARIANT=$var timeout 40 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $OUT/santa_variants.txt
cat $OUT/santa_variants.txt
