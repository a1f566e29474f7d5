#!/bin/bash
# GPU run 28 (session 8, final): GPU tests on the final kernels (SAAP: PDL chain removed, win_programs = 256;
# SANTA: prop PDL on), SANTA PDL on/off re-checked in separate processes, the full decode table.
cd "$(dirname "$0")/../.." || exit 1
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; } > $OUT/log.txt
step() { name=$1; lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s) - s ))s" >> $OUT/log.txt; }
step t_gpu 200 python3 -m pytest -q -m gpu tests/runtime/santa/test_santa_triton.py tests/runtime/saap/test_saap_triton.py -p no:cacheprovider
SANTA_TRITON_VARIANT=nopdl step santa_nopdl 40 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768
step table 200 python3 scripts/bench_decode.py --json $OUT/bench_decode.json
date -u >> $OUT/log.txt
cat $OUT/log.txt; tail -n 2 $OUT/t_gpu.txt; grep -E "^santa-" $OUT/santa_nopdl.txt | awk '{print $1,$2,$4,$5,$7}'
grep -A40 "^targets" $OUT/table.txt | head -12
