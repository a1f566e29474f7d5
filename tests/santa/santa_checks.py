"""Independent checks of a SANTA ``rl.dir`` after a run (used by the aggregator, resume and chaos tests).

Everything is re-derived from the files with plain numpy: snapshots, history, claim manifests and
claimed result files must agree, every result is counted at most once, and each committed theta
equals the REINFORCE step recomputed from the claimed records with each record's own policy.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def softmax64(theta: np.ndarray) -> np.ndarray:
    e = np.exp(theta - theta.max())
    return e / e.sum()


@dataclass
class RunFacts:
    iterations: int
    thetas: list[np.ndarray]
    counted: list[str]  # result ids in history order
    claimed_files: list[str]
    quarantined: list[str]  # quarantined file names (reason files excluded)
    inbox: list[str]  # result files still waiting
    temps: list[Path]  # hidden temp files anywhere


def temp_files(root: Path) -> list[Path]:
    return [Path(d) / f for d, _, files in os.walk(root) for f in files if f.startswith(".") and ".tmp-" in f]


def result_names(folder: Path) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".jsonl") and not f.startswith("."))


def check_rl_dir(root: Path, num_layers: int, budget: int, lr: float | None = 0.02) -> RunFacts:
    """``lr``: the step size every update must have used; None = each snapshot's recorded one."""
    root = Path(root)
    names = sorted(os.listdir(root / "policy"))
    visible = [n for n in names if not n.startswith(".")]
    its = sorted(int(re.fullmatch(r"policy-(\d+)\.json", n).group(1)) for n in visible)
    assert its == list(range(len(its))), f"snapshot iterations not consecutive: {its}"
    thetas, lrs = [], []
    for i in its:
        snap = json.loads((root / "policy" / f"policy-{i}.json").read_text())  # every snapshot parses
        assert snap["iteration"] == i and snap["budget"] == budget and len(snap["theta"]) == num_layers
        thetas.append(np.array(snap["theta"], dtype=np.float64))
        lrs.append(snap.get("lr"))
        assert np.all(np.isfinite(thetas[-1]))
    np.testing.assert_array_equal(thetas[0], np.zeros(num_layers))
    n = its[-1]
    counted: list[str] = []
    claimed_files: list[str] = []
    for k in range(1, n + 1):
        hist = json.loads((root / "history" / f"{k}.json").read_text())
        assert hist["iteration"] == k
        np.testing.assert_array_equal(hist["theta_before"], thetas[k - 1])
        np.testing.assert_array_equal(hist["theta_after"], thetas[k])
        manifest = json.loads((root / "claimed" / str(k) / "manifest.json").read_text())
        present = result_names(root / "claimed" / str(k))
        assert present == sorted(hist["files"]) and set(present) <= set(manifest["files"])
        records = []
        for f in present:
            lines = (root / "claimed" / str(k) / f).read_text().splitlines()
            recs = [json.loads(line) for line in lines]
            assert len(recs) == recs[0]["batch_size"], f"partial file consumed: {f}"
            records += sorted(recs, key=lambda r: r["index"])
        assert [r["result_id"] for r in records] == hist["result_ids"]
        # independent REINFORCE step with each record's own policy iteration
        s = np.array([r["schedule"] for r in records], dtype=np.float64)
        r = np.array([r_["reward"] for r_ in records], dtype=np.float64)
        p = np.stack([softmax64(thetas[rec["policy_iteration"]]) for rec in records])
        assert all(rec["policy_iteration"] <= k - 1 for rec in records)
        g = ((r - r.mean())[:, None] * (s - budget * p)).mean(axis=0)
        step = lrs[k] if lr is None else lr
        assert step == lrs[k] == hist["lr"]
        np.testing.assert_allclose(thetas[k], thetas[k - 1] + step * g, rtol=0, atol=1e-12)
        np.testing.assert_allclose(hist["baseline"], r.mean(), rtol=0, atol=1e-15)
        counted += hist["result_ids"]
        claimed_files += present
    assert len(counted) == len(set(counted)), "a result was counted twice"
    extra = [d for d in os.listdir(root / "claimed") if d.isdigit() and int(d) > n]
    assert all(int(d) == n + 1 for d in extra), f"claims beyond the next iteration: {extra}"
    inbox = result_names(root / "inbox")
    # a file still waiting may be garbage injected after the last claim (truncated JSON): its unparsable
    # lines hold no result id; the caller checks where the garbage went
    waiting_ids = {rec["result_id"] for f in inbox for rec in _parsable(root / "inbox" / f)}
    assert not waiting_ids & set(counted), "a counted result is still in the inbox"
    quarantined = sorted(f for f in os.listdir(root / "quarantine")
                         if not f.endswith(".reason.json") and not f.startswith("."))
    for q in quarantined:
        assert (root / "quarantine" / f"{q}.reason.json").exists(), f"no reason for quarantined {q}"
    return RunFacts(iterations=n, thetas=thetas, counted=counted, claimed_files=claimed_files,
                    quarantined=quarantined, inbox=inbox, temps=temp_files(root))


def _parsable(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "result_id" in rec:
            out.append(rec)
    return out


def result_lines(policy_iteration: int, schedules: list[list[int]], rewards: list[float], *, tag: str,
                 budget: int) -> list[dict]:
    """Records of one batch with deterministic ids (``tag`` makes them unique)."""
    batch = uuid.uuid5(uuid.NAMESPACE_OID, tag).hex
    return [{"result_id": uuid.uuid5(uuid.NAMESPACE_OID, f"{tag}/{e}").hex, "batch_id": batch,
             "batch_size": len(schedules), "index": e, "worker": "test", "policy_iteration": policy_iteration,
             "num_layers": len(s), "budget": budget, "schedule": s, "reward": r, "created": 0.0}
            for e, (s, r) in enumerate(zip(schedules, rewards))]


def publish_lines(root: Path, name: str, lines: list[dict] | bytes) -> Path:
    """Publish a result file into ``inbox/`` atomically (hidden temp + rename), as a worker would."""
    inbox = Path(root) / "inbox"
    inbox.mkdir(parents=True, exist_ok=True)
    data = lines if isinstance(lines, bytes) else "".join(json.dumps(x) + "\n" for x in lines).encode()
    tmp = inbox / f".{name}.tmp-test"
    tmp.write_bytes(data)
    os.replace(tmp, inbox / name)
    return inbox / name


def random_batch(rng: np.random.Generator, theta: np.ndarray, policy_iteration: int, budget: int, episodes: int,
                 tag: str) -> list[dict]:
    """A plausible batch drawn from ``theta`` with a synthetic reward favouring layer 0."""
    p = softmax64(theta)
    schedules = [rng.multinomial(budget, p).tolist() for _ in range(episodes)]
    rewards = [float(min(1.0, s[0] / budget * 2 + rng.uniform(0, 0.2))) for s in schedules]
    return result_lines(policy_iteration, schedules, rewards, tag=tag, budget=budget)
