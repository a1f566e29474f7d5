#!/bin/bash
# GPU run 21 (session 8, issue 4): saap-tiny v13 (the defaults: C = 256, l = 16) end to end at 8192 on four
# fresh held-out seeds x 100 prompts (400 per task), mass (SPEC) vs density ranking, and density at l = 32;
# per-prompt results (MLflow eval.json) copied out and pooled on the CPU (paired bootstrap over 400).
cd "$(dirname "$0")/../.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site outputs/whl_skinny/*.whl && export PYTHONPATH=/tmp/site || exit 1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_MININTERVAL=60
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; } > $OUT/log.txt
python3 -c "import mlflow; print('mlflow', mlflow.__version__)" >> $OUT/log.txt 2>&1 || { cat $OUT/log.txt; exit 1; }
A=artifacts/mlruns/501d397561bf49a8b49f736ca3f0d7b7/artifacts/artifact
ev() { name=$1; seed=$2; shift 2; s=$(date +%s)
  timeout 420 python3 -m calib eval artifact=$A "eval.tasks=[niah_single,kv_retrieval]" "eval.lengths=[8192]" eval.num_prompts=100 eval.seed=$seed "$@" > $OUT/ev_${name}_$seed.out 2> $OUT/ev_${name}_$seed.err
  echo "ev $name seed=$seed rc=$? $(( $(date +%s) - s ))s" >> $OUT/log.txt; }
for seed in 727272 737373 747474 757575; do
  ev mass16 $seed eval.top_l=16 &
  ev dens16 $seed eval.top_l=16 eval.ranking=density &
  ev dens32 $seed eval.top_l=32 eval.ranking=density &
done
wait
date -u >> $OUT/log.txt
mkdir -p $OUT/eval_json
for f in $OUT/ev_*.out; do
  rid=$(python3 -c "import json,sys;print(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])['run_id'])" $f 2>/dev/null) || continue
  j=$(find artifacts -path "*$rid*" -name eval.json | head -1); [ -n "$j" ] && cp $j $OUT/eval_json/$(basename $f .out).json
done
cat $OUT/log.txt; ls $OUT/eval_json | wc -l
