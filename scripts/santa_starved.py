"""SANTA acceptance: find a starved budget N, then learn a schedule at that N and score it held out.

    python scripts/santa_starved.py --lengths 2048 4096 --budgets 2 4 8 -- "data.tasks=[kv_retrieval]" rl.lr=1.0

Issue 7's criterion needs a budget where the uniform schedule's held-out reward lies in [--lo, --hi]
(0.3-0.7; the paper starved to 52%, not to zero). For each reward prompt length this runs
``python -m calib.santa.reward sweep=<budgets> method.reward.length=<length> [overrides]`` and reads its
uniform rewards; among the (length, budget_per_layer) points inside the band it picks the one whose
reward is nearest the band's middle (ties: the larger budget, more to reallocate), skipping
budget_per_layer 1 (N = L leaves nothing to move: every layer keeps at least one sample). Then it runs
``python -m calib run +method=santa rl.budget_per_layer=<b> method.reward.length=<length> [overrides]``
and prints one JSON line: the sweep table, the choice and the run's result (``reward_learned`` /
``reward_uniform`` with their CIs). Exit status 2 when no point falls in the band.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def last_json(stdout: str) -> dict:
    """The last stdout line that parses as a JSON object (the CLI's result convention)."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    raise ValueError("no JSON result line in the output")


def run(args: list[str]) -> dict:
    print("+ " + " ".join(args), file=sys.stderr, flush=True)
    proc = subprocess.run(args, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(args[:4])} ... exited {proc.returncode}")
    return last_json(proc.stdout)


def choose(table: dict[int, dict[str, dict]], lo: float, hi: float) -> tuple[int, int] | None:
    """(length, budget_per_layer) inside [lo, hi] nearest the middle; ties go to the larger budget."""
    mid = (lo + hi) / 2
    inside = [(round(abs(point["reward"] - mid), 9), -int(b), length, int(b))
              for length, sweep in table.items() for b, point in sweep.items()
              if b != "dense" and int(b) > 1 and lo <= point["reward"] <= hi]
    if not inside:
        return None
    _, _, length, budget = min(inside)
    return length, budget


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--budgets", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--lo", type=float, default=0.3)
    ap.add_argument("--hi", type=float, default=0.7)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for both the sweep and the run (after --)")
    args = ap.parse_args(argv)
    py = [sys.executable, "-m"]
    table = {}
    for length in args.lengths:
        out = run(py + ["calib.santa.reward", f"sweep={','.join(str(b) for b in args.budgets)}",
                        f"method.reward.length={length}", *args.overrides])
        table[length] = out["uniform_reward"]
        print(f"length {length}: " + ", ".join(f"{b}: {p['reward']:.2f}" for b, p in table[length].items()),
              file=sys.stderr, flush=True)
    pick = choose(table, args.lo, args.hi)
    if pick is None:
        print(json.dumps({"sweep": table, "choice": None}))
        print(f"error: no (length, budget_per_layer > 1) with uniform reward in [{args.lo}, {args.hi}]; "
              "try longer prompts, harder tasks or smaller budgets", file=sys.stderr)
        return 2
    length, budget = pick
    result = run(py + ["calib", "run", "+method=santa", f"rl.budget_per_layer={budget}",
                       f"method.reward.length={length}", *args.overrides])
    print(json.dumps({"sweep": table, "choice": {"length": length, "budget_per_layer": budget}, "run": result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
