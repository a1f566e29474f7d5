#!/bin/bash
# GPU run 79 (session 13): SANTA-prop gather variants graphed (each in its own process) and SAAP 128k B=1
# bucket-chain variants re-timed.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r79; mkdir -p $R
which ncu nsys > $R/profilers.txt 2>&1; ls /usr/local/cuda*/bin 2>/dev/null | grep -E "ncu|nsys" >> $R/profilers.txt; cat $R/profilers.txt
for var in ${SANTA_VARS:-default gt2 gr64 gt4w1 default}; do
  SANTA_TRITON_VARIANT=$var timeout 60 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-prop" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
timeout 150 python3 scripts/bench_decode.py --saap-variants default bkt-split2 split2-pv prefetch-v default --batches 1 --lengths 131072 > $R/saap_variants.txt 2>&1
echo "rc=$?" >> $R/saap_variants.txt; grep -A10 "^SAAP variants" $R/saap_variants.txt
cd $OUT && tar czf r79.tgz r79 && rm -rf r79
