"""Never slower: each attention layer runs the attached method only where it measured faster than dense.

A sparse method wins only where what it skips outweighs what it adds (a classifier, a selection pass,
a merge), which depends on the GPU, the batch, the length and the layer's own settings. Instead of
thresholds tuned on one card, the serving path times both on the running GPU the first time it meets
a shape and keeps the faster:

* decode (:func:`choose_dense_layers`, called by the static loop before it captures a view's graph):
  layers are grouped by the runtime's ``cost_signature(layer)`` (equal signatures cost the same; ``None``
  means the layer never beats dense); for one layer of each group the method's decode attention and
  flash-decoding are each captured in a small CUDA graph on the real cache view and replayed;
* prefill (:class:`PrefillChooser`, called by ``runtime_kernels.hf``): the first call of a layer at a
  length bucket warms both paths up, then times each a few times with CUDA events on the real inputs;
* whole prefills (:class:`PrefillGuard`, called by the static loop): a layer timed alone can win where the
  model's prefill, host-bound at small shapes, loses; the first prefill of a shape is repeated with the
  method on and off and the faster kept.

Decisions are cached per GPU, signature and shape in memory and in one JSON file
(``$CALIB_RUNTIME_CACHE`` or ``~/.cache/calib-runtime``), so a process pays each timing once per machine.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPLAYS = 20  # graph replays per timed decode candidate
PREFILL_REPEATS = 3  # timed calls per prefill candidate (the median decides)
PREFILL_GUARD_MS = 250.0  # a whole prefill is repeated to check the layers' choices only below this time
_LOCK = threading.Lock()
_MEMORY: dict[str, list[float]] = {}  # key -> [method_ms, dense_ms]
_LOADED = False
# (layer signatures, shape, GPU) -> (layers prepared, layers dense): choose_dense_layers' answers once every
# group is measured (asked at every new view of the static loop: a lookup instead of a walk over the layers)
_DECIDED: dict[tuple, tuple[frozenset[int], frozenset[int]]] = {}


def cache_path() -> Path:
    """The JSON file holding measured costs (``$CALIB_RUNTIME_CACHE/costs.json``)."""
    root = os.environ.get("CALIB_RUNTIME_CACHE") or Path.home() / ".cache" / "calib-runtime"
    return Path(root) / "costs.json"


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return
    if isinstance(data, dict):
        _MEMORY.update({k: v for k, v in data.items() if isinstance(v, list) and len(v) == 2
                        and all(isinstance(x, (int, float)) for x in v)})


def _store(key: str, method_ms: float, dense_ms: float) -> None:
    """Remember a measurement in memory and, best effort, on disk (atomic replace; a read-only home
    only loses the cache)."""
    _MEMORY[key] = [float(method_ms), float(dense_ms)]
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_MEMORY, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass


def measured(key: str) -> list[float] | None:
    """``[method_ms, dense_ms]`` recorded for ``key``, or None."""
    with _LOCK:
        _load()
        return _MEMORY.get(key)


def record(key: str, method_ms: float, dense_ms: float) -> None:
    with _LOCK:
        _load()
        _store(key, method_ms, dense_ms)
        _DECIDED.clear()


def forget_all() -> None:
    """Drop every cached decision, in memory (tests; a changed driver or kernel)."""
    global _LOADED
    with _LOCK:
        _MEMORY.clear()
        _DECIDED.clear()
        _LOADED = True


def can_time(device: torch.device) -> bool:
    """Whether costs can be measured on ``device`` (CUDA events and graphs); elsewhere the method runs
    wherever the artifact says, unmeasured."""
    return device.type == "cuda"


@functools.lru_cache(maxsize=None)
def device_key(device: torch.device) -> str:
    """The GPU model and software a timing holds for (asked before every new step graph: cached)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{name}|torch{torch.__version__}"


def length_bucket(n: int) -> int:
    """``n`` rounded up to one of eight steps per power of two (4096, 4608, ..., 7680, 8192, 9216, ...):
    lengths in one bucket share a prefill decision."""
    n = max(int(n), 1)
    top = 1 << (n - 1).bit_length()
    step = max(top // 16, 1)
    return -(-n // step) * step


def graph_ms(fn: Callable[[], Any], replays: int = REPLAYS) -> float:
    """Device milliseconds of one call of ``fn`` as a CUDA graph replay (launch costs as inside the
    serving loop's graph): two warm-up calls on a side stream (autotuning, lazy state), one capture,
    ``replays`` timed replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) / replays


def layer_signatures(runtime: Any, num_layers: int) -> tuple[str | None, ...] | None:
    """Every layer's cost signature: the runtime's ``cost_signatures()`` where it keeps them, else one
    ``cost_signature(layer)`` per layer; None for a runtime without signatures."""
    many = getattr(runtime, "cost_signatures", None)
    if many is not None:
        return many()
    one = getattr(runtime, "cost_signature", None)
    return None if one is None else tuple(one(layer) for layer in range(num_layers))


def choose_dense_layers(runtime: Any, num_layers: int, shape_key: str, device: torch.device,
                        prepare: Callable[[set[int]], None],
                        time_layer: Callable[[int], tuple[float, float] | None]) -> frozenset[int]:
    """The layers a static decode step should run densely: those whose cost signature
    (:func:`layer_signatures`) is None, and every layer of a signature group whose method time measured no
    faster than dense.

    ``prepare(layers)`` readies the method's state for the layers that may run it (SAAP builds their
    bucket index), before ``time_layer(layer) -> (method_ms, dense_ms)`` times one representative of each
    group not yet measured for ``(device, signature, shape_key)``; ``None`` from it (nothing can be timed
    here, e.g. no GPU) runs the method in that group, unrecorded. A runtime without signatures runs in
    every layer. A shape whose groups are all measured is answered from memory."""
    signatures = layer_signatures(runtime, num_layers)
    if signatures is None:
        prepare(set(range(num_layers)))
        return frozenset()
    memo = (signatures, shape_key, device_key(device))
    decided = _DECIDED.get(memo)
    if decided is not None:
        prepare(decided[0])
        return decided[1]
    groups: dict[str, list[int]] = {}
    for layer, sig in enumerate(signatures):
        if sig is not None:
            groups.setdefault(sig, []).append(layer)
    keys = {sig: f"decode|{memo[2]}|{sig}|{shape_key}" for sig in groups}
    costs = {sig: measured(key) for sig, key in keys.items()}
    all_measured = all(cost is not None for cost in costs.values())
    prepared = frozenset(layer for sig, members in groups.items() for layer in members
                         if costs[sig] is None or costs[sig][0] < costs[sig][1])
    prepare(prepared)
    for sig, members in groups.items():
        if costs[sig] is None:
            timed = time_layer(members[0])
            costs[sig] = [0.0, 1.0] if timed is None else list(timed)
            if timed is not None:
                record(keys[sig], *timed)
    method_layers = {layer for sig, members in groups.items() for layer in members if costs[sig][0] < costs[sig][1]}
    dense = frozenset(set(range(num_layers)) - method_layers)
    if all_measured:
        _DECIDED[memo] = (prepared, dense)
    return dense


class PrefillChooser:
    """Per (layer signature, batch, length bucket): does the prefill method beat dense attention here?

    :meth:`run` answers a prefill call. A decided shape runs the faster path; an undecided one runs the
    method and dense once each (warm-up: Triton compiles and autotunes on first use), then times each
    :data:`PREFILL_REPEATS` times on the same inputs (CUDA events, the median) and records the result.
    Decisions are also kept per chooser under a tuple key: a layer's prefill call of a small model lasts
    tens of microseconds of host time, so a decided shape builds no string and takes no lock.

    ``method_calls`` / ``dense_calls`` count the calls each path served (a benchmark reads how many layers
    of a prefill ran the method; :meth:`reset_counts` zeroes them)."""

    def __init__(self) -> None:
        self._decided: dict[tuple[str, int, int, int], bool] = {}
        self.method_calls = 0
        self.dense_calls = 0

    def reset_counts(self) -> None:
        self.method_calls = self.dense_calls = 0

    def run(self, signature: str | None, q: torch.Tensor, k: torch.Tensor,
            method: Callable[[], torch.Tensor | None], dense: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """The prefill output of ``method()`` or ``dense()`` (``None``: the caller's dense path), both
        ``[B, Hq, T, D]``.
        ``signature`` None: always the method (no GPU, or a runtime that gives none)."""
        if signature is None or not can_time(q.device):
            return self._served(method())
        shape = (signature, int(q.shape[0]), length_bucket(q.shape[2]), length_bucket(k.shape[2]))
        wins = self._decided.get(shape)
        if wins is None:
            key = f"prefill|{device_key(q.device)}|{signature}|B{shape[1]}|T{shape[2]}|Tk{shape[3]}"
            costs = measured(key)
            if costs is None:
                return self._decide(key, shape, method, dense)
            wins = self._decided[shape] = costs[0] < costs[1]
        return self._served(method() if wins else None)

    def _served(self, out: torch.Tensor | None) -> torch.Tensor | None:
        """Count ``out`` as a call the method served (None: dense) and pass it on."""
        if out is None:
            self.dense_calls += 1
        else:
            self.method_calls += 1
        return out

    def _decide(self, key: str, shape: tuple[str, int, int, int], method: Callable[[], torch.Tensor | None],
                dense: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """Time an undecided shape, record it, and return the faster path's output."""
        if method() is None:  # warm-up; None: the method does not take calls of this shape
            self._decided[shape] = False
            return self._served(None)
        dense()  # warm-up: the first call selects and loads its kernel
        method_ms, out = _median_ms(method)
        dense_ms, dense_out = _median_ms(dense)
        record(key, method_ms, dense_ms)
        wins = self._decided[shape] = method_ms < dense_ms
        self._served(out if wins else None)
        return out if wins else dense_out


def _median_ms(fn: Callable[[], Any], repeats: int = PREFILL_REPEATS) -> tuple[float, Any]:
    """The median of ``repeats`` timed calls of ``fn`` (one layer's prefill is a fraction of a millisecond
    on a small model: a single reading is within run-to-run noise) and the last call's output."""
    times, out = [], None
    for _ in range(repeats):
        ms, out = _event_ms(fn)
        times.append(ms)
    return sorted(times)[len(times) // 2], out


def _event_ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), out


class PrefillGuard:
    """Per (prefill artifact, batch, length bucket): is the model's whole prefill faster with the prefill
    method on (in the layers :class:`PrefillChooser` picked) than with it off?

    The chooser times one layer's attention alone, from an idle GPU. A short prefill of a small model is
    host-bound: there a method's extra launches cost their host time in full, while dense attention's
    device time hides behind the next layers' launches, so layers that win alone can lose together. The
    first prefill of a shape is run with the method (its layers decide), then, when that took under
    :data:`PREFILL_GUARD_MS` (repeating it is cheap), timed twice more each way, alternated (host wall
    time, synchronized), and the faster kept. Longer prefills are device-bound, which the chooser's
    timings predict: they are recorded as not compared (equal times) and keep the method's layers.
    When the first run's layers (``chooser``, the model's :class:`PrefillChooser`) all chose dense, the
    method-off path is that same work without the layers' lookups: it is kept without timing (in memory
    only: the layers' decisions are on disk, and lead here again).
    ``prefill(method_on)`` runs the prefill and returns its result; the guard's last call is always the
    chosen path, so the caller's cache holds that path's keys and values."""

    def __init__(self) -> None:
        self._decided: dict[str, bool] = {}

    def run(self, key: str, prefill: Callable[[bool], Any], chooser: PrefillChooser | None = None) -> Any:
        """``prefill(True)`` or ``prefill(False)``, decided for ``key`` (a shape's ``prefill-model|…`` key)."""
        wins = self._decided.get(key)
        if wins is None:
            costs = measured(key)
            if costs is not None:
                wins = self._decided[key] = costs[0] <= costs[1]
        if wins is not None:
            return prefill(wins)
        if chooser is not None:
            chooser.reset_counts()
        out = prefill(True)  # the layers' choices, warm-ups and compiles happen here
        if chooser is not None and chooser.method_calls == 0:
            self._decided[key] = False
            return out  # every layer ran dense: the cache holds the method-off path's keys and values
        method_ms, out = _wall_ms(lambda: prefill(True))
        if method_ms >= PREFILL_GUARD_MS:
            record(key, method_ms, method_ms)
            self._decided[key] = True
            return out
        dense_ms, _ = _wall_ms(lambda: prefill(False))
        again_ms, _ = _wall_ms(lambda: prefill(True))
        dense_again_ms, out = _wall_ms(lambda: prefill(False))
        method_ms, dense_ms = min(method_ms, again_ms), min(dense_ms, dense_again_ms)
        record(key, method_ms, dense_ms)
        self._decided[key] = method_ms <= dense_ms
        return prefill(True) if method_ms <= dense_ms else out


def _wall_ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Host wall time of ``fn`` from an idle device to its work done (host-bound work counts)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, out
