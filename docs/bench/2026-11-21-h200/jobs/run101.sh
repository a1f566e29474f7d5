#!/bin/bash
# GPU run 101 (session 15): SAAP 128k B=1 (2.94x, need 3x): the window partials on a side stream again in today's
# schedule (overlap_window=1; last measured in session 8, +4 us), with fewer window programs, and fewer / longer
# window tiles on the main stream; each config in its own process (SAAP_TRITON_CONFIG), graphed.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r101; mkdir -p $R
i=0
for cfg in "" "overlap_window=1" "overlap_window=1,win_programs=64" "min_win_steps=4" "win_programs=64" "" "overlap_window=1"; do
  i=$((i+1))
  SAAP_TRITON_CONFIG=$cfg timeout 90 python3 scripts/bench_decode.py --methods saap --batches 1 --lengths 131072 > /tmp/a_$i.txt 2>&1
  echo "== [$cfg] rc=$?"; grep -E "^saap " /tmp/a_$i.txt | awk '{print $1,$2,$3,$4,$5,$7,$12}'
done > $R/saap_variants.txt
cat $R/saap_variants.txt
cd $OUT && tar czf r101.tgz r101 && rm -rf r101
