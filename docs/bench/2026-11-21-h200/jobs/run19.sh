#!/bin/bash
# GPU run 19 (session 8): programmatic dependent launch for SAAP (rank -> partials -> merge) and SANTA
# (score -> budgets -> gather, stream -> merge): GPU tests with it on, then side-by-side timings.
cd "$(dirname "$0")/../.." || exit 1
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; } > $OUT/log.txt
step() { name=$1; lim=$2; shift 2; s=$(date +%s); timeout $lim "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s) - s ))s" >> $OUT/log.txt; }
export SAAP_TRITON_CONFIG=pdl=1 SANTA_TRITON_VARIANT=pdl
step t_gpu_pdl 170 python3 -m pytest -q -m gpu tests/runtime/santa/test_santa_triton.py tests/runtime/saap/test_saap_triton.py -p no:cacheprovider -x
unset SAAP_TRITON_CONFIG SANTA_TRITON_VARIANT
step saap_var 120 python3 scripts/bench_decode.py --saap-variants default pdl pdl-split2 pdl-prefetch pdl-split2-prefetch
step santa_def 60 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768
SANTA_TRITON_VARIANT=pdl step santa_pdl 60 python3 scripts/bench_decode.py --methods santa --batches 1 8 --lengths 8192 32768
date -u >> $OUT/log.txt
cat $OUT/log.txt; tail -n 2 $OUT/t_gpu_pdl.txt; tail -n 30 $OUT/saap_var.txt; for f in santa_def santa_pdl; do echo "== $f"; grep "santa\|sdpa" $OUT/$f.txt | head -12; done
