#!/bin/bash
# GPU run 27 (session 8; run 26 had: default s3 winp256 winp512 winp256-s3 winp512-s3 winp1024-s3 winp512-s3-w8): SAAP window tiles capped by a program budget (win_programs) and deeper pipelines,
# aimed at B=8 8k where the 2048-key window streams at ~1.5 TB/s in 1024 two-step programs.
cd "$(dirname "$0")/../.." || exit 1
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; } > $OUT/log.txt
step() { name=$1; lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s) - s ))s" >> $OUT/log.txt; }
step saap_win 150 python3 scripts/bench_decode.py --saap-variants winp256 default nopdl winp256-nopdl winp128 default
cat $OUT/log.txt; grep -A40 "^SAAP variants" $OUT/saap_win.txt
