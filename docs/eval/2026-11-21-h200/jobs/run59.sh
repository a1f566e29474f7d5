#!/bin/bash
# GPU run 59 (session 10, issue 4): hybrid bucket ranking (half of l by classifier mass, half by the group's inner
# product with the centroids) on the tuning seeds 616161 / 626262, niah_single at 8192, saap-tiny v13.
cd "$(dirname "$0")/../.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site outputs/whl_skinny/*.whl && export PYTHONPATH=/tmp/site || exit 1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_MININTERVAL=60
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; } > $OUT/log.txt
A=artifacts/mlruns/501d397561bf49a8b49f736ca3f0d7b7/artifacts/artifact
touch /tmp/stamp
ev() { name=$1; seed=$2; shift 2; s=$(date +%s)
  timeout 500 python3 -m calib eval artifact=$A "eval.tasks=[niah_single]" "eval.lengths=[8192]" eval.num_prompts=100 eval.seed=$seed "$@" > /tmp/ev_${name}_$seed.out 2> /tmp/ev_${name}_$seed.err
  echo "ev $name seed=$seed rc=$? $(( $(date +%s) - s ))s" >> $OUT/log.txt; }
for seed in 616161 626262; do
  ev hyb16 $seed eval.top_l=16 eval.ranking=hybrid &
  ev hyb32 $seed eval.top_l=32 eval.ranking=hybrid &
  ev hyb64 $seed eval.top_l=64 eval.ranking=hybrid &
  ev hyb128 $seed eval.top_l=128 eval.ranking=hybrid &
done
wait
date -u >> $OUT/log.txt
mkdir -p /tmp/e; i=0
for j in $(find artifacts -name eval.json -newer /tmp/stamp); do i=$((i+1)); cp $j /tmp/e/$i.json; done
tail -n 3 /tmp/ev_*.err > /tmp/e/stderr_tails.txt
tar czf $OUT/evals.tgz -C /tmp e
cat $OUT/log.txt; echo "eval.json files: $i"; grep -h "niah\|select" /tmp/ev_*.out | head -40
