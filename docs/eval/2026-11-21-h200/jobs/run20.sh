#!/bin/bash
# GPU run 20 (session 8, issue 4): SAAP tiny with fewer buckets (C = 64, calibrated on the CPU: saap-tiny v14), end-to-end niah_single / kv_retrieval at 8192 on the *tuning* seed 616161, 100 prompts per task,
# default mass ranking, several l (4 evals in parallel on the one GPU).
cd "$(dirname "$0")/../.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_MININTERVAL=60
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; } > $OUT/log.txt
A64=artifacts/mlruns/fde7c7bd631a4b8b9b90c16c9c2d6cb1/artifacts/artifact
ev() { name=$1; art=$2; L=$3; shift 3; s=$(date +%s)
  timeout 400 python3 -m calib eval artifact=$art "eval.tasks=[niah_single,kv_retrieval]" "eval.lengths=[8192]" eval.num_prompts=100 eval.seed=616161 eval.top_l=$L "$@" > $OUT/ev_${name}_l$L.out 2> $OUT/ev_${name}_l$L.err
  echo "ev $name l=$L rc=$? $(( $(date +%s) - s ))s" >> $OUT/log.txt; }
ev c64 $A64 2 & ev c64 $A64 4 & ev c64 $A64 8 & ev c64dens $A64 4 eval.ranking=density & wait
date -u >> $OUT/log.txt
cat $OUT/log.txt
python3 - <<'PY'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/ev_*.out")):
    try: r = json.loads(open(f).read().strip().splitlines()[-1])
    except Exception as e: print(f, "error", e); continue
    m, t = r.get("metrics", {}), r.get("tasks", {})
    print(os.path.basename(f), "niah", t.get("niah_single@8192"), "ci", m.get("niah_single@8192.diff_ci_low"), m.get("niah_single@8192.diff_ci_high"),
          "sel", round(m.get("niah_single@8192.selectivity", -1), 4), "| kv", t.get("kv_retrieval@8192"), "sel", round(m.get("kv_retrieval@8192.selectivity", -1), 4))
PY
