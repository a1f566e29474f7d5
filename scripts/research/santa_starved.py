"""SANTA acceptance: find a starved budget N, then learn a schedule at that N and score it held out.

    python scripts/research/santa_starved.py --lengths 2048 4096 --budgets 2 4 --totals 5 6 7 -- method.tiling=none rl.lr=1.0

The acceptance criterion (docs/results/santa.md) needs a budget where the uniform schedule's held-out reward lies in [--lo, --hi]
(0.3-0.7; the paper starved to 52%, not to zero). For each reward prompt length this runs
``python -m calib.santa.sweep sweep=<budgets> sweep_total=<totals> method.reward.length=<length>
[overrides]`` and reads its uniform rewards (budgets per layer, and total budgets N, which may sit
between L and 2L when one sample per layer starves the model and two do not); among the (length, N)
points inside the band it picks the one whose reward is nearest the band's middle (ties: the larger N,
more to reallocate), skipping N = L (it leaves nothing to move: every layer keeps at least one sample).
Then it runs ``python -m calib run +method=santa rl.budget=<N> method.reward.length=<length>
[overrides]`` and prints one JSON line: the sweep table, the choice and the run's result
(``reward_learned`` / ``reward_uniform``, and for N not a multiple of L ``reward_uniform_mean`` /
``reward_uniform_best`` over every placement of the extra samples, with their CIs). Exit status 2 when
no point falls in the band.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
    """(length, total N) whose uniform reward lies in [lo, hi], nearest the middle; ties: the larger N.

    Candidates are the uniform schedules of the sweep (``"<budget_per_layer>"`` and ``"N<total>"``
    entries, each with its ``schedule``; the reward is that of the θ = 0 schedule, the ``uniform`` a
    run compares against), never N = L (one sample per layer leaves nothing to reallocate), never
    ``dense`` nor a placement entry (``"N<total>:..."``).
    """
    mid = (lo + hi) / 2
    inside = []
    for length, sweep in table.items():
        for name, point in sweep.items():
            if name == "dense" or ":" in name:
                continue
            schedule = point["schedule"]
            total = int(sum(schedule))
            if total > len(schedule) and lo <= point["reward"] <= hi:
                inside.append((round(abs(point["reward"] - mid), 9), -total, length, total))
    if not inside:
        return None
    _, _, length, total = min(inside)
    return length, total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--budgets", type=int, nargs="+", default=[2, 4, 8], help="budgets per layer")
    ap.add_argument("--totals", type=int, nargs="*", default=[],
                    help="total budgets N (between L and 2L: a budget finer than one more sample per layer)")
    ap.add_argument("--lo", type=float, default=0.3)
    ap.add_argument("--hi", type=float, default=0.7)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for both the sweep and the run (after --)")
    args = ap.parse_args(argv)
    py = [sys.executable, "-m"]
    table = {}
    for length in args.lengths:
        totals = [f"sweep_total={','.join(str(n) for n in args.totals)}"] if args.totals else []
        out = run(py + ["calib.santa.sweep", f"sweep={','.join(str(b) for b in args.budgets)}", *totals,
                        f"method.reward.length={length}", *args.overrides])
        table[length] = out["uniform_reward"]
        print(f"length {length}: " + ", ".join(f"{b}: {p['reward']:.2f}" for b, p in table[length].items()),
              file=sys.stderr, flush=True)
    pick = choose(table, args.lo, args.hi)
    if pick is None:
        print(json.dumps({"sweep": table, "choice": None}))
        print(f"error: no (length, N > L) with uniform reward in [{args.lo}, {args.hi}]; "
              "try longer prompts, harder tasks or finer budgets (--totals)", file=sys.stderr)
        return 2
    length, total = pick
    result = run(py + ["calib", "run", "+method=santa", f"rl.budget={total}",
                       f"method.reward.length={length}", *args.overrides])
    print(json.dumps({"sweep": table, "choice": {"length": length, "budget": total}, "run": result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
