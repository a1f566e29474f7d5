#!/bin/bash
# GPU run 22 (session 8): GPU tests with the new defaults (SANTA prop PDL on; SAAP PDL at B >= 2) and the
# new PDL tests; SANTA launch variants at the missed B=8 8k and B=1 32k points; the full decode table.
cd "$(dirname "$0")/../.." || exit 1
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; } > $OUT/log.txt
step() { name=$1; lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s) - s ))s" >> $OUT/log.txt; }
step t_gpu 200 python3 -m pytest -q -m gpu tests/runtime/santa/test_santa_triton.py tests/runtime/saap/test_saap_triton.py -p no:cacheprovider
for var in default bk128 tpp4 w8 bk32 nopdl; do
  SANTA_TRITON_VARIANT=$var step santa_$var 40 python3 scripts/bench_decode.py --methods santa --batches 8 --lengths 8192
done
step table 200 python3 scripts/bench_decode.py --json $OUT/bench_decode.json
date -u >> $OUT/log.txt
cat $OUT/log.txt; tail -n 3 $OUT/t_gpu.txt
for var in default bk128 tpp4 w8 bk32 nopdl; do echo "== $var"; grep -E "^santa-" $OUT/santa_$var.txt | awk '{print $1,$2,$4,$5,$7,$12}'; done
grep -A40 "^targets" $OUT/table.txt | head -40
