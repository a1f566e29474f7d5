#!/bin/bash
# GPU run 49 (session 9): where SAAP's attention half spends its time (scripts/bench_saap_attention.py).
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r49; mkdir -p $R
for bt in "8 8192" "1 131072" "8 131072"; do set -- $bt
  timeout 60 python3 scripts/bench_saap_attention.py --batch $1 --length $2 > $R/attn_b$1_t$2.txt 2>&1; echo "rc=$?" >> $R/attn_b$1_t$2.txt
  cat $R/attn_b$1_t$2.txt
done
cd $OUT && tar czf r49.tgz r49 && rm -rf r49
