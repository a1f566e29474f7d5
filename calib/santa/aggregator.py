"""The SANTA REINFORCE aggregator (Lee et al., arXiv:2605.01910, App. K Alg. 1 lines 10-15, App. L).

Whenever result files are in ``inbox/``, it judges each (:meth:`Aggregator.judge`; refused entries go to
``quarantine/`` with their reason), claims the rest for iteration ``k`` and commits update ``k`` (quoted:
the ``fault_hook`` points where the crash tests kill it)::

    1. write claimed/k/manifest.json (the file list, atomically)            "after-manifest"
    2. rename each file inbox/ -> claimed/k/                                "after-first-move", "after-moves"
    3. theta_k from theta_{k-1} and the claimed records, each with the p of its own policy_iteration
    4. check the lease, publish policy/policy-k.json exclusively (temp + fsync + link:
       THE COMMIT POINT of iteration k)                                     "after-snapshot"
    5. write history/k.json (atomically)                                    "after-history"
    6. call on_iteration(record) (MLflow logging)

It never waits for or signals workers; ``policy-0`` (theta = 0) is written at the first start. A restart
repairs every crash window before anything else (:meth:`Aggregator.recover`), so no iteration is skipped
or reused and every result counts at most once. One aggregator at a time: :class:`calib.santa.lease.Lease`,
and the ``link`` of step 4 refuses to replace a snapshot, so a split brain cannot commit an iteration
twice. The protocol in brief: docs/methods.md (SANTA, "Worker/aggregator protocol").
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import stat
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from calib.errors import UserError
from calib.santa.inbox import (
    Layout,
    MalformedResult,
    PolicySnapshot,
    ResultRecord,
    list_results,
    move_claimed,
    parse_result_file,
    policy_iterations,
    quarantine,
    read_manifest,
    read_policy,
    regular_results,
    sweep_temp_files,
    write_manifest,
)
from calib.santa.lease import Lease, LeaseLost
from calib.santa.policy import NonFiniteUpdate, reinforce_update, softmax
from calib.santa.volume import (atomic_write_json, entry_kind, exclusive_publish_json, is_temp_name, printable,
                               read_json)

log = logging.getLogger("calib.santa.aggregator")

CRASH_POINTS = ("after-manifest", "after-first-move", "after-moves", "after-snapshot", "after-history")


class CorruptState(RuntimeError):
    """The shared directory contradicts the protocol (e.g. a gap in the snapshots); needs a human."""


@dataclass
class IterationRecord:
    """``history/<iteration>.json``: what update ``iteration`` consumed and produced."""

    iteration: int
    theta_before: list[float]
    theta_after: list[float]
    baseline: float
    gradient: list[float]
    result_ids: list[str]
    files: list[str]
    rewards: list[float]
    policy_iterations: list[int]  # per result, the policy that produced its schedule
    lr: float
    budget: int
    committed_at: float
    quarantined: list[str] = field(default_factory=list)  # files quarantined while claiming
    rebuilt: bool = False  # rebuilt after a crash between snapshot and history
    replayed: bool = False  # not stored: set when the callback is re-invoked after a restart

    @property
    def num_results(self) -> int:
        return len(self.result_ids)

    @property
    def probs_after(self) -> np.ndarray:
        return softmax(np.asarray(self.theta_after))

    def metrics(self) -> dict[str, float]:
        """Flat per-iteration metrics for a tracker (MLflow ``log_metrics(..., step=iteration)``)."""
        p = self.probs_after
        stale = [self.iteration - 1 - i for i in self.policy_iterations]
        return {"baseline": self.baseline, "num_results": float(self.num_results),
                "grad_norm": float(np.linalg.norm(self.gradient)),
                "policy_entropy": float(-(p * np.log(np.maximum(p, 1e-300))).sum()),
                "staleness_mean": float(np.mean(stale)), "staleness_max": float(max(stale)),
                "num_quarantined": float(len(self.quarantined))}

    def to_json(self) -> dict[str, Any]:
        obj = asdict(self)
        obj.pop("replayed")
        obj["num_results"] = self.num_results
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "IterationRecord":
        names = {f for f in cls.__dataclass_fields__ if f != "replayed"}
        return cls(**{k: v for k, v in obj.items() if k in names})


@dataclass
class AggregatorSummary:
    iteration: int  # the newest committed iteration
    committed: list[int]  # iterations committed by this call
    quarantined: list[str]
    swept: int
    stopped_because: str


FaultHook = Callable[[str, int], None]


@dataclass(frozen=True)
class Verdict:
    """What :meth:`Aggregator.judge` made of one entry: usable (``ok``), refused (``reason``) or gone."""

    records: list[ResultRecord]  # the entry's records when usable, else []
    reason: str = ""  # why it must be quarantined; "" when usable or when the entry vanished

    @property
    def ok(self) -> bool:
        return bool(self.records)


class Aggregator:
    """The aggregator's state over one shared directory; :func:`run_aggregator` drives it."""

    def __init__(self, rl_dir: str | Path, num_layers: int, budget: int, *, lr: float,
                 on_iteration: Callable[[IterationRecord], None] | None, fault_hook: FaultHook | None):
        if num_layers < 1 or budget < num_layers:
            raise UserError(f"santa needs num_layers >= 1 and a budget of at least one sample per layer "
                            f"(got {num_layers} layers, budget {budget}): raise rl.budget_per_layer")
        if not (math.isfinite(lr) and lr > 0):
            raise UserError(f"rl.lr must be a positive number (got {lr})")
        self.layout = Layout(Path(rl_dir))
        self.num_layers, self.budget, self.lr = num_layers, budget, lr
        self.on_iteration = on_iteration
        self.fault = fault_hook or (lambda point, iteration: None)
        self.current = -1  # newest committed iteration
        self.counted: set[str] = set()
        self.thetas: dict[int, np.ndarray] = {}
        self.quarantined: list[str] = []
        self._claim_quarantined: list[str] = []
        self.stuck: set[str] = set()  # inbox entries refused but impossible to move: skipped from now on
        self.last_record: IterationRecord | None = None  # the newest committed iteration's record
        self.lease: Lease | None = None  # checked before every claim and commit

    def check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check()

    # ------------------------------------------------------------------------------ recovery

    def recover(self) -> int | None:
        """Bring the directory to a consistent state; return a pending iteration to redo, or None.

        Takes ``c``, the newest snapshot (snapshots 0..c must be consecutive), then repairs each crash
        window of the commit (module docstring):

        * killed while writing the manifest (before step 1 completes): ``claimed/k/`` holds at most a
          hidden temp file and every result is still in ``inbox/``; the temp files are removed and the
          results claimed afresh (new arrivals may join: nothing was counted yet).
        * "after-manifest" / "after-first-move" / "after-moves" (between 1 and 4, the snapshot's temp write
          included): no ``policy-k``, so iteration ``k`` never happened. The manifest fixes the claim: listed
          files still in ``inbox/`` are moved, later arrivals are not part of it, and update ``k`` is redone
          from exactly the listed files (same bytes, order and theta_{k-1}: the same numbers).
        * "after-snapshot" (between 4 and 5): ``policy-k`` exists, so ``k`` is complete; its missing
          ``history/k.json`` is rebuilt from the manifest and the claimed files (``rebuilt``), after checking
          that recomputing the update reproduces the committed theta.
        * "after-history" (between 5 and 6): the callback may not have run; after every restart it is called
          again for the newest committed iteration with ``replayed=True`` (at least once for the last one).
        * killed while quarantining: the reason file is written before the rename, so the entry is either
          still in ``inbox/`` (judged again) or already in ``quarantine/``.
        * a claim manifest that is missing, does not parse, or names anything but plain result files of its
          claim (a path separator, ``..``, an absolute path, a symlink) is not trusted: the claim is the
          regular result files in ``claimed/k/`` (:meth:`_claim_files`).
        * killed anywhere: temp files (``.<name>.tmp-*``) are hidden from every reader and swept once older
          than ``temp_max_age_s``.

        "Counted" means listed in a committed history's ``result_ids`` (rebuilt here into ``self.counted``).
        """
        layout = self.layout.ensure()
        its = policy_iterations(layout)
        if not its:
            snap = PolicySnapshot(0, np.zeros(self.num_layers), self.budget)
            exclusive_publish_json(layout.policy_file(0), snap.to_json())
            its = [0]
        if its != list(range(its[-1] + 1)):
            raise CorruptState(f"policy snapshots in {layout.policy} are not consecutive: {its}")
        first = read_policy(layout, 0)
        if first.num_layers != self.num_layers or first.budget != self.budget:
            raise UserError(f"{layout.root} holds a run with {first.num_layers} layers and budget {first.budget}, "
                            f"not {self.num_layers} and {self.budget}: use another rl.dir or matching settings")
        self.current = its[-1]
        for j in range(1, self.current + 1):
            record = self._history_or_rebuild(j)
            self.counted.update(record.result_ids)
            self.last_record = record
        return self._pending_claim(self.current + 1)

    def _history_or_rebuild(self, j: int) -> IterationRecord:
        try:
            return IterationRecord.from_json(read_json(self.layout.history_file(j)))
        except (OSError, ValueError, TypeError):
            pass
        files = self._claim_files(j)
        if not files:
            raise CorruptState(f"iteration {j} is committed but has neither history nor claimed files")
        records, used = self._load_claimed(j, files, quarantine_bad=False)
        snap = read_policy(self.layout, j)
        record = self._compute(j, used, records, lr=snap.lr if snap.lr is not None else self.lr)
        committed = self._theta(j)
        if not np.allclose(committed, record.theta_after, rtol=0, atol=1e-12):
            raise CorruptState(f"recomputing iteration {j} from claimed/{j} does not give policy-{j}")
        record.theta_after = [float(x) for x in committed]
        record.rebuilt = True
        atomic_write_json(self.layout.history_file(j), record.to_json())
        log.warning("rebuilt history/%d.json from its claim manifest", j)
        return record

    def _pending_claim(self, k: int) -> int | None:
        layout = self.layout
        later = [int(p.name) for p in layout.claimed.iterdir()
                 if p.name.isascii() and p.name.isdigit() and int(p.name) > k]
        if later:
            raise CorruptState(f"claimed/{max(later)} exists but the newest snapshot is policy-{k - 1}")
        d = layout.claim_dir(k)
        mode = os.lstat(d).st_mode if os.path.lexists(d) else None
        if mode is None:
            return None
        if not stat.S_ISDIR(mode):  # a link or file the aggregator never makes: out of the way
            self._quarantine(d, f"claimed/{k} is {entry_kind(mode)}, not a claim folder", origin="claimed")
            return None
        if self._claim_files(k):
            log.warning("iteration %d was claimed but not committed: redoing it from its claim", k)
            return k
        self._abandon_claim(k)  # killed while writing the manifest (or it was refused): claim afresh
        if os.path.lexists(d):  # something foreign is left in it: move the whole folder out of the way
            self._quarantine(d, f"claimed/{k} holds no usable claim", origin="claimed")
        return None

    def _claim_files(self, k: int) -> list[str]:
        """The files of claim ``k``: its manifest's list, or, when the manifest is missing or not
        trusted (:func:`read_manifest`), the regular result files in ``claimed/k/``, which then
        become its manifest (other entries named like results are quarantined, never read)."""
        files = read_manifest(self.layout, k)
        if files is not None:
            return files
        d = self.layout.claim_dir(k)
        files = regular_results(d)
        for name in sorted(set(list_results(d)) - set(files)):
            self._quarantine(d / name, "not a regular file", origin=f"claimed/{k}")
        if files:
            log.warning("claimed/%d/manifest.json is missing or not trusted: the claim is its %d result files",
                        k, len(files))
            write_manifest(self.layout, k, files)
        return files

    # ------------------------------------------------------------------------------ claiming

    def _theta(self, iteration: int) -> np.ndarray:
        if iteration not in self.thetas:
            self.thetas[iteration] = read_policy(self.layout, iteration).theta
        return self.thetas[iteration]

    def judge(self, path: Path, seen: set[str], k: int) -> Verdict:
        """Whether the entry ``path`` may count in update ``k``: the one place entries are accepted.

        Usable: a complete, valid result file (:func:`parse_result_file` opens no link, FIFO or
        directory and bounds size and nesting before parsing) whose policy iterations are older than
        ``k`` and have snapshots, and whose result ids are neither counted (``self.counted``) nor seen
        in another file of this claim (``seen``). Anything else gets the reason it is refused.
        """
        try:
            records = parse_result_file(path, self.num_layers, self.budget)
            self._check_against_state(records, seen, k)
        except FileNotFoundError:
            return Verdict([])
        except (OSError, ValueError) as exc:  # MalformedResult is a ValueError
            return Verdict([], str(exc) or type(exc).__name__)
        return Verdict(records)

    def _check_against_state(self, records: list[ResultRecord], seen: set[str], k: int) -> None:
        for r in records:
            if r.policy_iteration >= k:
                raise MalformedResult(f"policy_iteration {r.policy_iteration} is newer than policy-{k - 1}")
            try:
                self._theta(r.policy_iteration)
            except (OSError, ValueError):
                raise MalformedResult(f"policy_iteration {r.policy_iteration} has no readable snapshot") from None
        dup = next((r.result_id for r in records if r.result_id in self.counted or r.result_id in seen), None)
        if dup is not None:
            raise MalformedResult(f"result_id {dup} was already counted")

    def _quarantine(self, path: Path, reason: str, origin: str) -> None:
        """Move ``path`` to quarantine/ with its reason and count it; if it cannot be moved, skip it
        from now on (its reason file says so) rather than judge it again at every poll."""
        try:
            name = quarantine(self.layout, path, reason, origin=origin).name
            log.warning("quarantined %s: %s", printable(path.name), reason)
        except FileNotFoundError:
            return
        except OSError as exc:
            name = path.name
            self.stuck.add(name)
            log.warning("refused %s (%s) but cannot move it to quarantine (%s): skipping it", printable(name), reason, exc)
        self.quarantined.append(name)
        self._claim_quarantined.append(name)

    def claim_inbox(self) -> int | None:
        """Validate the inbox, claim the good files for iteration current+1; None if nothing to claim."""
        k = self.current + 1
        good: list[str] = []
        seen: set[str] = set()
        for name in list_results(self.layout.inbox):
            if name in self.stuck:
                continue
            verdict = self.judge(self.layout.inbox / name, seen, k)
            if verdict.reason:
                self._quarantine(self.layout.inbox / name, verdict.reason, origin="inbox")
            elif verdict.ok:
                seen.update(r.result_id for r in verdict.records)
                good.append(name)
        if not good:
            return None
        self.check_lease()
        write_manifest(self.layout, k, good)
        self.fault("after-manifest", k)
        return k

    def _load_claimed(self, k: int, files: list[str], *, quarantine_bad: bool) -> tuple[list[ResultRecord], list[str]]:
        records: list[ResultRecord] = []
        used: list[str] = []
        seen: set[str] = set()
        for name in sorted(files):
            path = self.layout.claim_dir(k) / name
            verdict = self.judge(path, seen, k)
            if verdict.reason and not quarantine_bad:
                raise CorruptState(f"committed claimed/{k}/{name} is malformed: {verdict.reason}")
            if verdict.reason:
                self._quarantine(path, verdict.reason, origin=f"claimed/{k}")
            elif not verdict.ok:
                log.warning("claimed/%d/%s listed in the manifest is gone (quarantined before a crash?)", k, printable(name))
            else:
                seen.update(r.result_id for r in verdict.records)
                records += verdict.records
                used.append(name)
        return records, used

    # ------------------------------------------------------------------------------ committing

    def _compute(self, k: int, files: list[str], records: list[ResultRecord], lr: float) -> IterationRecord:
        theta = self._theta(k - 1)
        probs = np.stack([softmax(self._theta(r.policy_iteration)) for r in records])  # [K, L]
        schedules = np.asarray([r.schedule for r in records], dtype=np.float64)  # [K, L]
        rewards = np.asarray([r.reward for r in records], dtype=np.float64)  # [K]
        step = reinforce_update(theta, schedules, rewards, probs, lr)
        return IterationRecord(
            iteration=k, theta_before=[float(x) for x in theta], theta_after=[float(x) for x in step.theta],
            baseline=step.baseline, gradient=[float(x) for x in step.gradient],
            result_ids=[r.result_id for r in records], files=sorted(files), rewards=[r.reward for r in records],
            policy_iterations=[r.policy_iteration for r in records], lr=lr, budget=self.budget,
            committed_at=time.time())

    def commit(self, k: int) -> IterationRecord | None:
        """Move the manifest's files, compute and commit iteration ``k``; None if nothing valid remained
        (a non-finite update is rejected: its files are quarantined and theta stays)."""
        files = self._claim_files(k)
        unmoved = move_claimed(self.layout, k, files, lambda i: self.fault("after-first-move", k) if i == 0 else None)
        for name in unmoved:
            self._quarantine(self.layout.inbox / name, f"could not be moved into claimed/{k}", origin="inbox")
        self.fault("after-moves", k)
        records, used = self._load_claimed(k, files, quarantine_bad=True)
        try:
            record = self._compute(k, used, records, self.lr) if records else None
        except NonFiniteUpdate as exc:
            for name in used:
                self._quarantine(self.layout.claim_dir(k) / name, str(exc), origin=f"claimed/{k}")
            record = None
        if record is None:
            self._abandon_claim(k)
            return None
        record.quarantined = list(self._claim_quarantined)
        self.check_lease()
        snapshot = PolicySnapshot(k, np.asarray(record.theta_after), self.budget, lr=self.lr)
        if not exclusive_publish_json(self.layout.policy_file(k), snapshot.to_json()):
            raise LeaseLost(f"policy-{k} was committed by another aggregator; stopping")
        self.fault("after-snapshot", k)
        atomic_write_json(self.layout.history_file(k), record.to_json())
        self.fault("after-history", k)
        self.current = k
        self.thetas[k] = snapshot.theta
        self.counted.update(record.result_ids)
        self._claim_quarantined = []
        self.last_record = record
        return record

    def _abandon_claim(self, k: int) -> None:
        """Nothing valid in claim ``k``: drop its manifest so ``k`` is claimed afresh later."""
        with contextlib.suppress(OSError):
            self.layout.manifest_file(k).unlink()
        d = self.layout.claim_dir(k)
        with contextlib.suppress(FileNotFoundError):
            for p in d.iterdir():
                if is_temp_name(p.name):
                    with contextlib.suppress(OSError):
                        p.unlink()
        with contextlib.suppress(OSError):  # stays if something else is in it; the next claim reuses it
            d.rmdir()

    def notify(self, record: IterationRecord) -> None:
        if self.on_iteration is not None:
            self.on_iteration(record)


def run_aggregator(
    rl_dir: str | Path,
    num_layers: int,
    budget: int,
    *,
    iterations: int,
    lr: float = 0.02,
    poll_s: float = 1.0,
    lease_ttl_s: float = 30.0,
    temp_max_age_s: float = 600.0,
    on_iteration: Callable[[IterationRecord], None] | None = None,
    stop_event: threading.Event | None = None,
    lease_wait_s: float | None = None,
    fault_hook: FaultHook | None = None,
) -> AggregatorSummary:
    """Run the aggregator on ``rl_dir`` until ``iterations`` updates are committed (or ``stop_event``).

    num_layers: L; budget: the total N of a schedule (``rl.budget_per_layer * L``). Resumes whatever
    the directory holds. Raises ``LeaseHeld`` if another aggregator keeps the lease for
    ``lease_wait_s`` seconds (None: wait, taking a stale lease over after ``lease_ttl_s``),
    ``LeaseLost`` if the lease is taken over while running, ``UserError`` on a mismatched directory.
    ``fault_hook(point, iteration)`` is called at each of :data:`CRASH_POINTS` (the crash-window tests
    kill the process there).
    """
    for name, value in (("poll_s", poll_s), ("lease_ttl_s", lease_ttl_s), ("temp_max_age_s", temp_max_age_s)):
        if not value > 0:
            raise UserError(f"rl.{name} must be > 0 (got {value})")
    if iterations < 0:
        raise UserError(f"rl.iterations must be >= 0 (got {iterations})")
    agg = Aggregator(rl_dir, num_layers, budget, lr=lr, on_iteration=on_iteration, fault_hook=fault_hook)
    agg.layout.root.mkdir(parents=True, exist_ok=True)
    lease = agg.lease = Lease(agg.layout.lease, ttl_s=lease_ttl_s)
    lease.acquire(wait_s=lease_wait_s, poll_s=min(poll_s, lease_ttl_s / 4), log=log.info)
    stop = stop_event or threading.Event()
    committed: list[int] = []
    swept = 0
    try:
        swept += len(sweep_temp_files(agg.layout, temp_max_age_s))
        pending = agg.recover()
        if agg.current < iterations:
            with contextlib.suppress(FileNotFoundError):
                agg.layout.done.unlink()
        if agg.last_record is not None:  # its callback may not have run before a crash
            agg.last_record.replayed = True
            agg.notify(agg.last_record)
        sweep_every = min(max(temp_max_age_s / 2, poll_s), 60.0)
        last_sweep = time.monotonic()
        reason = "iterations"
        while agg.current < iterations:
            if stop.is_set():
                reason = "stop_event"
                break
            if lease.lost:  # the heartbeat found another owner: stop before touching anything
                raise LeaseLost(f"the aggregator lease {lease.path} was taken over; stopping")
            if time.monotonic() - last_sweep >= sweep_every:
                swept += len(sweep_temp_files(agg.layout, temp_max_age_s))
                last_sweep = time.monotonic()
            k = pending if pending is not None else agg.claim_inbox()
            pending = None
            if k is None:
                stop.wait(poll_s)
                continue
            record = agg.commit(k)
            if record is None:
                continue
            committed.append(k)
            log.info("iteration %d: %d results, baseline %.4f", k, record.num_results, record.baseline)
            agg.notify(record)
        if agg.current >= iterations:
            atomic_write_json(agg.layout.done, {"iterations": agg.current, "time": time.time()})
        return AggregatorSummary(iteration=agg.current, committed=committed, quarantined=agg.quarantined,
                                 swept=swept, stopped_because=reason)
    finally:
        lease.release()


def exit_on_sigterm() -> None:
    """Turn SIGTERM (``kubectl delete``, a Recreate rollout) into SystemExit so the lease is released
    at once instead of after ``lease_ttl_s``. Call from the main thread of a command."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
