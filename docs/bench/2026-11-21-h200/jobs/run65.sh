#!/bin/bash
# GPU run 65 (session 11): where the ranking's ~6 us in sequence go: the ranking kernel ended after each
# stage (STOP profiles), alone and after layers 1 and 2; warps.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r65; mkdir -p $R
timeout 120 python3 scripts/bench_saap_classifier.py --batch 1 > $R/cls_b1.txt 2>&1; echo "rc=$?" >> $R/cls_b1.txt
grep -iE "rank|layer1 \+|rc=" $R/cls_b1.txt | head -40
cd $OUT && tar czf r65.tgz r65 && rm -rf r65
