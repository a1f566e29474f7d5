#!/bin/bash
# GPU run 23 (session 8, issue 4): which default l passes niah_single on *tuning* seeds (616161, 626262;
# 2 x 100 prompts at 8192, saap-tiny v13, C = 256): mass l in {64, 96, 128}, density l in {48, 64}.
# Per-prompt eval.json of every run in one tarball (the device returns only a few files).
cd "$(dirname "$0")/../.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site outputs/whl_skinny/*.whl && export PYTHONPATH=/tmp/site || exit 1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_MININTERVAL=60
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; } > $OUT/log.txt
A=artifacts/mlruns/501d397561bf49a8b49f736ca3f0d7b7/artifacts/artifact
touch /tmp/stamp
ev() { name=$1; seed=$2; shift 2; s=$(date +%s)
  timeout 400 python3 -m calib eval artifact=$A "eval.tasks=[niah_single]" "eval.lengths=[8192]" eval.num_prompts=100 eval.seed=$seed "$@" > /tmp/ev_${name}_$seed.out 2> /tmp/ev_${name}_$seed.err
  echo "ev $name seed=$seed rc=$? $(( $(date +%s) - s ))s" >> $OUT/log.txt; }
for seed in 616161 626262; do
  ev mass64 $seed eval.top_l=64 &
  ev mass96 $seed eval.top_l=96 &
  ev mass128 $seed eval.top_l=128 &
  ev dens48 $seed eval.top_l=48 eval.ranking=density &
  ev dens64 $seed eval.top_l=64 eval.ranking=density &
done
wait
date -u >> $OUT/log.txt
mkdir -p /tmp/e; i=0
for j in $(find artifacts -name eval.json -newer /tmp/stamp); do i=$((i+1)); cp $j /tmp/e/$i.json; done
tail -n 3 /tmp/ev_*.err > /tmp/e/stderr_tails.txt
tar czf $OUT/evals.tgz -C /tmp e
cat $OUT/log.txt; echo "eval.json files: $i"
