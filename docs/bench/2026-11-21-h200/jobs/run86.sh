#!/bin/bash
# GPU run 86 (session 14): SANTA-prop chunked gather (score-pass chunk statistics, one 32-key chunk of
# scores read per sample): GPU tests on it, the gather stage alone, then graphed variants in own processes.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r86; mkdir -p $R
SANTA_TRITON_VARIANT=ch timeout 200 python3 -m pytest -q -m gpu tests/runtime/santa > $R/gpu_tests_ch.txt 2>&1
echo "gpu tests ch rc=$?" >> $R/gpu_tests_ch.txt; tail -2 $R/gpu_tests_ch.txt
timeout 150 python3 scripts/bench_santa_stages.py --tilings prop --batches 1 8 --lengths 8192 32768 --variants default ch ch_gt1 ch_gt4 ch_s8 > $R/stages.txt 2>&1
echo "stages rc=$?" >> $R/stages.txt; grep -E "gather|scores|rc=" $R/stages.txt
for var in ${SANTA_VARS:-default ch ch_gt1 ch_gt4 ch_s8 default ch}; do
  SANTA_TRITON_VARIANT=$var timeout 60 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-prop" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
cd $OUT && tar czf r86.tgz r86 && rm -rf r86
