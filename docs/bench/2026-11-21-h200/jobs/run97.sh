#!/bin/bash
# GPU run 97 (session 14): SAAP 128k B=1 (2.94x, need 3x): window tiles of one 64-key step (min_win_steps=1:
# one dependent K/V round trip less per window program, 16 more partials) and 16-column merge programs,
# each config in its own process (SAAP_TRITON_CONFIG), graphed.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r97; mkdir -p $R
i=0
for cfg in "" "min_win_steps=1" "merge_block_d=16" "min_win_steps=1,merge_block_d=16" "" "min_win_steps=1"; do
  i=$((i+1))
  SAAP_TRITON_CONFIG=$cfg timeout 90 python3 scripts/bench_decode.py --methods saap --batches 1 8 --lengths 8192 131072 > /tmp/a_$i.txt 2>&1
  echo "== [$cfg] rc=$?"; grep -E "^saap " /tmp/a_$i.txt | awk '{print $1,$2,$3,$4,$5,$7,$12}'
done > $R/saap_variants.txt
cat $R/saap_variants.txt
cd $OUT && tar czf r97.tgz r97 && rm -rf r97
