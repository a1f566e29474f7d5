#!/bin/bash
# GPU run 71 (session 11, issue 4): per-layer l. Layers 1-2 at the default l = 16, layer 3 (the retrieval /
# copy heads: the single-layer diagnosis on tuning seed 616161 broke niah only there) at 192 of 256 buckets,
# on FRESH held-out seeds 808080..838383 (never used before), niah_single + kv_retrieval at 8192, saap-tiny v13,
# mass ranking (the spec's). Context on two of the seeds: layer 3 at 128, and l = 192 on every layer.
cd "$(dirname "$0")/../.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site outputs/whl_skinny/*.whl && export PYTHONPATH=/tmp/site || exit 1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_MININTERVAL=60
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; } > $OUT/log.txt
A=artifacts/mlruns/501d397561bf49a8b49f736ca3f0d7b7/artifacts/artifact
touch /tmp/stamp
ev() { name=$1; seed=$2; shift 2; s=$(date +%s)
  timeout 560 python3 -m calib eval artifact=$A "eval.tasks=[niah_single,kv_retrieval]" "eval.lengths=[8192]" eval.num_prompts=100 eval.seed=$seed "$@" > /tmp/ev_${name}_$seed.out 2> /tmp/ev_${name}_$seed.err
  echo "ev $name seed=$seed rc=$? $(( $(date +%s) - s ))s" >> $OUT/log.txt; }
for seed in 808080 818181 828282 838383; do ev l3_192 $seed "eval.top_l_layers={3:192}" & done
for seed in 808080 818181; do
  ev l3_128 $seed "eval.top_l_layers={3:128}" &
  ev all_192 $seed eval.top_l=192 &
done
wait
date -u >> $OUT/log.txt
mkdir -p /tmp/e; i=0
for j in $(find artifacts -name eval.json -newer /tmp/stamp); do i=$((i+1)); cp $j /tmp/e/$i.json; done
tail -n 3 /tmp/ev_*.err > /tmp/e/stderr_tails.txt
cp /tmp/ev_*.out /tmp/e/ 2>/dev/null
tar czf $OUT/evals.tgz -C /tmp e
cat $OUT/log.txt; echo "eval.json files: $i"; grep -h "niah\|kv_\|select\|diff" /tmp/ev_*.out | head -60
