#!/bin/bash
# GPU run 80 (session 13): ncu of SANTA-prop's score pass and gather at B=8 32k (where the time goes),
# gather tiles x register cap graphed.
cd "$(dirname "$0")/../.." || exit 1
R=$OUT/r80; mkdir -p $R
for var in default gt2; do
  SANTA_TRITON_VARIANT=$var timeout 150 ncu --kernel-name regex:"_prop_gather_kernel|_score_kernel|_prop_budget_kernel" --launch-skip 3 --launch-count 3 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    python3 outputs/gpu_jobs/prof_santa.py 8 32768 prop 2 > $R/ncu_$var.txt 2>&1
  echo "ncu $var rc=$?" >> $R/ncu_$var.txt
done
grep -E "^  _|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Stall|No Eligible|Issued Warp|rc=|ERR" $R/ncu_default.txt | head -80
for var in default gt2 gt2r64 gt2r80 gt2w1 default; do
  SANTA_TRITON_VARIANT=$var timeout 60 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768 > /tmp/s_$var.txt 2>&1
  echo "== $var rc=$?"; grep -E "^santa-prop" /tmp/s_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'
done > $R/santa_variants.txt
cat $R/santa_variants.txt
cd $OUT && tar czf r80.tgz r80 && rm -rf r80
