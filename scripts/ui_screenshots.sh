#!/usr/bin/env bash
# PNG screenshots of the MLflow UI on the project's store, as `python -m calib ui` serves it: the runs
# table (the headline-columns view calib ui prints), the newest calibration run's page, the newest
# registered version with eval tags (else the newest) and its registered model's page (docs/mlflow.md
# shows two of them).
#
#   bash scripts/ui_screenshots.sh [OUT_DIR=docs/img] [PORT=5099]
#
# Needs a store with at least one `calib run` (ideally also a `calib eval artifact=models:/...`): the
# store `calib ui` opens (CALIB_HOME / MLFLOW_TRACKING_URI as usual). Headless Chromium from Debian's
# package (`apt-get install chromium`); without it the script says so in one line and exits 0.
# PYTHON picks the interpreter (default: python). The server listens on UI_HOST (default 127.0.0.2, a
# loopback address): the MLflow UI opens its assistant side panel over every page when the address is
# literally localhost / 127.0.0.1, and a fresh browser profile per shot would show it each time.
set -euo pipefail
out=${1:-docs/img}
port=${2:-5099}
py=${PYTHON:-python}
host=${UI_HOST:-127.0.0.2}
browser=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$browser" ]; then
  echo "skip: no chromium on PATH (apt-get install chromium); no screenshots taken"
  exit 0
fi
mkdir -p "$out"
work=$(mktemp -d)
"$py" -m calib ui --host "$host" --port "$port" -- --allowed-hosts "$host:$port" \
  --cors-allowed-origins "http://$host:$port" >"$work/ui.log" 2>&1 &
ui_pid=$!
cleanup() {
  kill -TERM "$ui_pid" 2>/dev/null || true
  wait "$ui_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# The pages to shoot, from the URLs calib ui printed and the REST API: "<file> <width,height> <url>" per
# line (each window just tall enough for what the page shows).
"$py" - "$work/ui.log" >"$work/pages.txt" <<'EOF'
import json, re, sys, time, urllib.error, urllib.request

log = sys.argv[1]
deadline = time.time() + 300
while True:
    text = open(log).read()
    view = re.search(r"headline columns: (\S+)", text)
    if view:
        base = view.group(1).split("/#/")[0]
        try:
            urllib.request.urlopen(f"{base}/health", timeout=5)
            break
        except OSError:
            pass
    if time.time() > deadline:
        sys.exit(f"the MLflow UI did not answer within 300 s:\n{text}")
    time.sleep(1)
experiment = re.search(r"#/experiments/([^/]+)/runs", view.group(1)).group(1)


def call(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{base}/api/2.0/mlflow/{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


runs = call("runs/search", {"experiment_ids": [experiment], "order_by": ["attributes.start_time DESC"]})
calibration = [r for r in runs.get("runs", []) if not r["info"].get("run_name", "").startswith("eval ")]
if not calibration:
    sys.exit("no calib run in the store yet: run `python -m calib run +method=<name>` first")
print(f"runs_table.png 1920,560 {view.group(1)}")
run_id = calibration[0]["info"]["run_id"]
print(f"run_page.png 1920,900 {base}/#/experiments/{experiment}/runs/{run_id}?workflowType=machine_learning")
versions = call("model-versions/search?max_results=1000").get("model_versions", [])
evaluated = [v for v in versions if any(t["key"].startswith("eval.") for t in v.get("tags", []))]
if versions:  # the newest version with held-out eval tags, else the newest
    newest = max(evaluated or versions, key=lambda v: int(v["creation_timestamp"]))
    print(f"model_version.png 1920,900 {base}/#/models/{newest['name']}/versions/{newest['version']}")
    print(f"registered_model.png 1920,760 {base}/#/models/{newest['name']}")
EOF

while read -r file size url; do
  "$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$(mktemp -d -p "$work")" --hide-scrollbars --window-size="$size" \
    --virtual-time-budget=20000 --screenshot="$out/$file" "$url" >/dev/null 2>&1
  echo "$out/$file  <- $url"
done <"$work/pages.txt"
