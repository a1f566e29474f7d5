"""Greedy generation on a preallocated KV cache, one CUDA graph per decode step: the serving path.

transformers' ``DynamicCache`` copies the whole cache every step and its static cache attends the full
buffer under a mask, and a method's per-step work is tens of small kernels per layer. So
:class:`StaticGenerator` owns a :class:`~runtime_kernels.static_cache.StaticKVCache` the model's layers write
in place and captures one decode step of the whole (unmodified) model in a CUDA graph, gpt-fast style: a step
costs one replay.

* Views: the layers see ``cache[:, :, :view]``, ``view`` the valid length rounded up to
  :attr:`StaticGenerator.bucket`; one graph per view length reached, kept across requests when the step
  reads no state of one request (a later request replays it instead of capturing). The valid length lives on the
  device (``StaticKVCache.length``, ``AttentionCall.cache_len``): no host sync per step.
* Dense decode steps run flash-decoding on the valid length (the calib attention function is attached
  when nothing is); before each capture the serving policy picks the layers a method runs in
  (:mod:`runtime_kernels.serving_policy`); method state that moves with the view (SAAP's index) is
  updated by ``before_graph`` outside the graph (SAAP's lists in storage kept across requests, ending
  where the view puts them, so its step graphs are kept too).
* Prefill runs eagerly; prompts of different lengths (a ragged batch) decode together, each row at its
  own position. Rows of close lengths, wherever they sit in the batch, prefill in one call, the shorter ones
  padded after their last token (a causal prefill of a row never reads what follows it, and decoding
  overwrites the padding), each row's first token read at its own last position (:func:`ragged_runs`); with
  a prefill method attached, which sees the whole sequence, each row prefills alone unless the method takes
  padded rows (``ragged_prefill``).
* ``compile=True`` runs each step's model call through ``torch.compile`` (the norms, rotary and MLP
  kernels fused; attention and the cache update stay eager graph breaks), compiled at the first two
  view lengths only. Design notes: docs/notes/serving-loop.md.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from transformers.cache_utils import DynamicCache

from runtime_kernels import fused_linears, hf
from runtime_kernels.ragged import batch_rows, ragged_runs
from runtime_kernels.serving_policy import can_time, choose_dense_layers, device_key, graph_ms, length_bucket
from runtime_kernels.static_cache import StaticKVCache

DEFAULT_BUCKET = 256  # positions per view length; SANTA's tile, so a view never splits a tile


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


@dataclass
class StepTimes:
    """What one :meth:`StaticGenerator.generate` call measured (milliseconds; ``None`` off CUDA)."""

    prefill_ms: float | None = None  # prompt forward + first token (time to first token), device time
    step_ms: list[float] = field(default_factory=list)  # device time per decode step (graph replays only)
    host_ms: list[float] = field(default_factory=list)  # host time to issue each step
    captures: int = 0  # graphs captured
    capture_ms: float = 0.0  # host time spent warming up and capturing (not in step_ms nor compile_ms)
    compiles: int = 0  # frames torch.compile compiled (compiled decoding: the first two view lengths)
    compile_ms: float = 0.0  # host time of the warm-ups (or steps, without graphs) that compiled
    view_ms: float = 0.0  # host time bringing the cache and method state to each new view (a method's index
    # upkeep; the serving policy's layer timing at a shape's first use), outside the graphs

    def add_compiles(self, frames_before: int, ms: float) -> bool:
        """Count the frames compiled since ``frames_before`` (:func:`frames_compiled`) and, if any, the
        ``ms`` of host time they were compiled in; returns whether there were any."""
        n = frames_compiled() - frames_before
        self.compiles += n
        self.compile_ms += ms if n else 0.0
        return n > 0


def frames_compiled() -> int:
    """Frames torch.compile (dynamo) has tried to compile in this process: it counts each compile and
    recompile (0 before dynamo is first imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["frames"]["total"]) if utils is not None else 0


def _layer_index_unspecialized() -> contextlib.AbstractContextManager[Any]:
    """Dynamo config under which int attributes of modules, such as each attention layer's
    ``layer_idx`` (passed to the cache), become dynamic inputs on recompile instead of one constant,
    and one compile, per layer (module docstring)."""
    config = torch._dynamo.config  # imported by torch.compile, which built the compiled model
    if not hasattr(config, "allow_unspec_int_on_nn_module"):  # pragma: no cover - torch 2.11-2.13 have it
        return contextlib.nullcontext()
    return config.patch(allow_unspec_int_on_nn_module=True)


class StaticGenerator:
    """Greedy decoding of a transformers causal LM on a :class:`StaticKVCache` (module docstring).

    ``graphs=False`` runs the same steps eagerly (CPU, debugging, and the reference the graph path is
    tested against). With calib methods attached (``runtime_kernels.hf.apply`` before or after
    construction) the decode runtime sees ``ctx.cache_len``; dense layers and models run flash-decoding on
    the valid length.

    ``fuse_projections=True`` (the default) rewrites the model in place so that each layer's query, key
    and value projections, and its MLP's gate and up projections, run as one GEMM each
    (:func:`runtime_kernels.fused_linears.fuse_projections`: same weights, same ``state_dict``, no copy);
    a decode step pays three fewer weight GEMMs per layer. Place the model on its device first.

    ``compile=True`` runs each decode step's model call through ``torch.compile`` (module docstring:
    what is fused, what stays eager, the bounded compile count); it costs compile time at the first two
    view lengths, so it pays off for long generations and benchmarks, not for a few tokens.
    """

    def __init__(self, model: Any, *, batch: int, max_len: int, graphs: bool | None = None,
                 bucket: int = DEFAULT_BUCKET, compile: bool = False, fuse_projections: bool = True) -> None:
        self.model = model
        if fuse_projections:
            fused_linears.fuse_projections(model)
        if getattr(model, "calib_attention", None) is None:  # dense decode steps run flash-decoding on the
            hf.attach(model)                                  # valid length, not SDPA on the masked view
        # decode steps only: prefill calls self.model, eagerly
        self._decode_model = torch.compile(model) if compile else model
        self.compile = bool(compile)
        self.cache = StaticKVCache.for_model(model, batch, round_up(max_len, bucket))
        self.device = self.cache.keys[0].device
        self.graphs = (self.device.type == "cuda") if graphs is None else bool(graphs)
        if self.graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.bucket = int(bucket)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=self.device)  # the step's input token
        self.pos = torch.zeros(batch, dtype=torch.long, device=self.device)  # each row's position
        # the shortest and longest rows' positions, kept on the host (every step advances all rows by one),
        # so the loop never reads them back from the device (a host sync per request and view)
        self._shortest = self._longest = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_view = -1
        self._kept: dict[int, tuple[Any, dict]] = {}  # id(decode runtime) -> (it, its kept graphs), _kept_graphs
        self._kept_state: Any = None  # the calib state the kept graphs were captured under
        # one memory pool for every graph of this generator: a graph replaced at a new view length
        # returns its memory to the pool once the next one is captured
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._cache_arg = cache_argument(model)

    # ---------------------------------------------------------------------------------- pieces
    def _state(self) -> Any | None:
        return getattr(self.model, "calib_attention", None)

    @contextlib.contextmanager
    def _decoding(self, view: int) -> Iterator[None]:
        """Tell the cache and the attached calib runtimes that calls are static-cache decode steps of
        ``view`` keys."""
        state = self._state()
        if state is not None:
            state.static_len = self.cache.length
        self.cache.step_pos = self.pos
        try:
            yield
        finally:
            self.cache.step_pos = None
            if state is not None:
                state.static_len = None

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with _layer_index_unspecialized() if self.compile else contextlib.nullcontext():
            out = self._decode_model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                                     cache_position=position_ids[0], use_cache=True, logits_to_keep=1,
                                     **{self._cache_arg: self.cache})
        return out.logits[:, -1]  # [B, V]

    def _step(self) -> None:
        """One decode step, all on the device: write position, length, mask, forward, argmax, advance."""
        c = self.cache
        torch.add(self.pos, 1, out=c.length)
        mask = (torch.arange(c.view, device=self.device)[None, :] < c.length[:, None])[:, None, None, :]
        logits = self._forward(self.token, self.pos[:, None], mask)
        self.token.copy_(logits.argmax(-1, keepdim=True))
        self.pos.add_(1)

    def _before_view(self, view: int, times: StepTimes | None = None) -> None:
        """:meth:`_bring_to_view`, its host time added to ``times.view_ms``."""
        t0 = time.perf_counter()
        self._bring_to_view(view)
        if times is not None:
            times.view_ms += (time.perf_counter() - t0) * 1e3

    def _bring_to_view(self, view: int) -> None:
        """Bring the cache view and method state to ``view`` keys (outside any graph) and, under
        ``serve="fastest"``, choose the layers the step runs densely (:mod:`runtime_kernels.serving_policy`)."""
        self.cache.view = view
        state = self._state()
        runtime = getattr(state, "decode", None) if state is not None else None
        if runtime is None:
            return
        hook = getattr(runtime, "before_graph", None)

        def prepare(layers: set[int] | None) -> None:
            if hook is not None:
                # keys the shortest row holds at this step (a ragged batch's longer rows attend the rest
                # densely, runtime_kernels.saap.api.SaapDecode.before_graph)
                hook(self.cache, self._shortest + 1, view, layers, stable=max(0, view - self.bucket))

        if state.serve != "fastest":
            state.serve_dense = frozenset()
            prepare(None)
            return
        k = self.cache.keys[0]
        shape_key = f"B{k.shape[0]}|T{view}|Hq{self.model.config.num_attention_heads}|Hkv{k.shape[1]}|D{k.shape[3]}|{k.dtype}"
        state.serve_dense = choose_dense_layers(runtime, len(self.cache.keys), shape_key, self.device, prepare,
                                                lambda layer: self._time_layer(runtime, state, layer, view))

    def _time_layer(self, runtime: Any, state: Any, layer: int, view: int) -> tuple[float, float] | None:
        """Device ms of one decode attention call of ``layer`` at ``view``: the method's, flash-decoding's
        (a random query on the real cache; each a CUDA graph replay, :func:`serving_policy.graph_ms`);
        None without CUDA graphs (nothing to compare with: the method runs)."""
        if not self.graphs:
            return None
        k, v = self.cache.keys[layer][:, :, :view], self.cache.values[layer][:, :, :view]
        heads = self.model.config.num_attention_heads
        q = torch.randn(k.shape[0], heads, 1, k.shape[3], device=self.device, dtype=k.dtype)
        cache_len = self.pos + 1
        ctx = hf.AttentionCall(None, self.pos[:, None], state.rotary_emb, None, cache_len)
        scale = k.shape[3] ** -0.5
        stats = runtime.stats_checkpoint() if hasattr(runtime, "stats_checkpoint") else None

        def method() -> torch.Tensor | None:
            return runtime.decode(layer, q, k, v, scale, ctx)

        if method() is None:  # the method does not take this step (no index, ...): dense
            return float("inf"), 0.0
        method_ms = graph_ms(method)
        dense_ms = graph_ms(lambda: flash_decode(q, k, v, scale, cache_len))
        if hasattr(runtime, "stats_restore"):
            runtime.stats_restore(stats)
        return method_ms, dense_ms

    def _warm_up(self, view: int) -> None:
        """Two steps on a side stream, undone: Triton autotuning, lazy init and torch.compile's
        compilation happen here, never inside capture. The decode runtime's statistics, where it keeps
        them (``stats_checkpoint``/``stats_restore``), skip these steps."""
        token, pos = self.token.clone(), self.pos.clone()
        runtime = getattr(self._state(), "decode", None)
        stats = runtime.stats_checkpoint() if hasattr(runtime, "stats_checkpoint") else None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), self._decoding(view):
            for _ in range(2):
                self._step()
                self.token.copy_(token)
                self.pos.copy_(pos)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if hasattr(runtime, "stats_restore"):
            runtime.stats_restore(stats)

    def _capture(self, view: int) -> None:
        """Capture :meth:`_step` for ``view`` (after :meth:`_warm_up`)."""
        token, pos = self.token.clone(), self.pos.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool), self._decoding(view):
            self._step()
        self.token.copy_(token)
        self.pos.copy_(pos)
        # the previous graph goes only now: a pool whose last graph is gone cannot take a new capture
        self._graph, self._graph_view = graph, view

    def _kept_graphs(self, state: Any) -> dict[tuple[int, frozenset[int], Any], torch.cuda.CUDAGraph]:
        """The step graphs kept across requests under ``state`` and its decode runtime, by (view, layers
        served densely, the runtime's ``graph_variant`` if it has one); a new attachment drops them.

        A later request that reaches a view replays the kept graph instead of warming up and capturing
        (the first-to-second-token time of a request). A step may be kept when it reads only the loop's
        own buffers (cache, token, positions, lengths), the weights and buffers a runtime never replaces
        (its statistics sums, seeds): a dense step, a ``reads_request_state = False`` runtime's (FlashDecode;
        S²ANTA, whose draws are keyed on seed and position; SAAP whose indexes end where the view puts them,
        in storage it keeps), or one in which the attached method ran in no layer (SAAP's layers at ℓ = C,
        every layer chosen dense). A step that read this request's state (a SAAP index of a ragged batch's
        short row) is captured anew for each request (:meth:`_keeps`). Graphs are kept per
        runtime object (held here, so its id is not reused): a state whose decode runtime is switched off
        and on again (a benchmark's in-process dense) keeps both sets."""
        runtime = getattr(state, "decode", None)
        if state is not self._kept_state:
            self._kept, self._kept_state = {}, state
        entry = self._kept.get(id(runtime))
        if entry is None:
            entry = self._kept[id(runtime)] = (runtime, {})
        return entry[1]

    @staticmethod
    def _keeps(state: Any) -> bool:
        """Whether the step just captured may serve later requests (:meth:`_kept_graphs`)."""
        runtime = getattr(state, "decode", None)
        return (runtime is None or not getattr(runtime, "reads_request_state", True)
                or not state.static_method_layers)

    def _graph_at(self, view: int, times: StepTimes | None) -> None:
        """Make the step graph for ``view`` current: the cache and method state brought to ``view``
        (:meth:`_before_view`), then a kept graph for it, else a new capture (kept where allowed)."""
        self._before_view(view, times)
        state = self._state()
        kept = self._kept_graphs(state)
        runtime = getattr(state, "decode", None)
        key = (view, state.serve_dense if runtime is not None else frozenset(), getattr(runtime, "graph_variant", None))
        graph = kept.get(key)
        if graph is None:
            if state is not None:
                state.static_method_layers = set()
            self._new_graph(view, times)
            if self._keeps(state):
                kept[key] = self._graph
            return
        self._graph, self._graph_view = graph, view

    def _new_graph(self, view: int, times: StepTimes | None) -> None:
        """Warm up and capture the step's graph at ``view`` (the cache and methods already brought there)."""
        frames, t0 = frames_compiled(), time.perf_counter()
        self._warm_up(view)
        t1 = time.perf_counter()
        self._capture(view)
        if times is not None:
            warm_ms = (t1 - t0) * 1e3
            compiled = times.add_compiles(frames, warm_ms)
            times.captures += 1
            times.capture_ms += (time.perf_counter() - t1) * 1e3 + (0.0 if compiled else warm_ms)

    # ---------------------------------------------------------------------------------- public
    @torch.inference_mode()
    def prefill(self, input_ids: "torch.Tensor | Sequence[Sequence[int]]") -> torch.Tensor:
        """Run the prompts into the cache; returns the first new token of each row ``[B, 1]``.

        ``input_ids``: a ``[B, T]`` tensor (one call), or ``B`` rows of token ids whose lengths may
        differ (a ragged batch: one call per run of :func:`ragged_runs`, module docstring)."""
        rows = input_ids if isinstance(input_ids, torch.Tensor) else [list(r) for r in input_ids]
        lengths = [len(r) for r in rows] if not isinstance(rows, torch.Tensor) else [rows.shape[1]] * rows.shape[0]
        if len(lengths) != self.cache.batch:
            raise ValueError(f"this generator was built for batch {self.cache.batch}, got {len(lengths)} prompts")
        if min(lengths) < 1 or max(lengths) >= self.cache.max_len:
            raise ValueError(f"prompts of {min(lengths)}-{max(lengths)} tokens: an empty prompt has no next token, "
                             f"and one of {self.cache.max_len} or more leaves no room in a cache of {self.cache.max_len}")
        if len(set(lengths)) == 1:
            ids = rows if isinstance(rows, torch.Tensor) else torch.tensor(rows)
            self.token.copy_(self._prefill_rows(ids.to(self.device), slice(None)))
        else:
            state = self._state()
            prefill = None if state is None else state.prefill
            alone = prefill is not None and not getattr(prefill, "ragged_prefill", False)
            for run in ragged_runs(lengths, alone):
                part = [rows[i] for i in run]
                longest = max(len(row) for row in part)
                ids = torch.tensor([row + row[-1:] * (longest - len(row)) for row in part], dtype=torch.long)
                first = self._prefill_rows(ids.to(self.device), batch_rows(run), [len(row) - 1 for row in part])
                self.token.index_copy_(0, torch.tensor(run, device=self.device), first)
        self.cache.length.copy_(torch.tensor(lengths))
        self.pos.copy_(self.cache.length)
        self._shortest, self._longest = min(lengths), max(lengths)
        self._graph_view = -1  # the graph itself goes at the next capture: its pool must outlive it
        return self.token.clone()

    def _prefill_rows(self, input_ids: torch.Tensor, rows: slice | list[int], last: list[int] | None = None
                      ) -> torch.Tensor:
        """One causal prefill call of ``input_ids [b, T]`` into cache ``rows``; the next token ``[b, 1]``,
        predicted at position ``T - 1`` or, with ``last``, at each row's ``last[i]`` (rows padded after it)."""
        c, state = self.cache, self._state()
        b, t = input_ids.shape
        keep = 1 if last is None else t - min(last)  # logits of positions t - keep .. t - 1
        c.view, c.rows = t, rows if isinstance(rows, slice) else torch.tensor(rows, device=self.device)
        c.write_pos = torch.arange(t, device=self.device)
        if state is not None:
            state.static_rows = rows
            state.static_lengths = None if last is None else [n + 1 for n in last]

        def forward(method_on: bool) -> torch.Tensor:
            # no mask: an unpadded causal prefill from position 0, which transformers' mask creation turns
            # into SDPA's is_causal (and which the prefill methods require, hf._plain_prefill)
            method = None if method_on else state.prefill  # off: only asked of a state with a prefill method
            if not method_on:
                state.prefill = None
            try:
                return self.model(input_ids=input_ids, position_ids=c.write_pos[None].expand(b, t), use_cache=True,
                                  logits_to_keep=keep, **{self._cache_arg: c}).logits
            finally:
                if not method_on:
                    state.prefill = method

        try:
            logits = self._guarded_prefill(state, b, t, forward)
        finally:
            c.rows = slice(None)
            if state is not None:
                state.static_rows, state.static_lengths = None, None
        if last is None:
            return logits[:, -1].argmax(-1, keepdim=True)
        at = torch.tensor(last, device=logits.device) - (t - keep)
        return logits[torch.arange(b, device=logits.device), at].argmax(-1, keepdim=True)

    def _guarded_prefill(self, state: Any, b: int, t: int, forward: Callable[[bool], torch.Tensor]) -> torch.Tensor:
        """``forward(True)``, or under ``serve="fastest"`` on CUDA with a prefill method whichever of
        ``forward(True)`` / ``forward(False)`` (method off) the whole prefill measured faster at this shape
        (:class:`runtime_kernels.serving_policy.PrefillGuard`)."""
        if (state is None or state.prefill is None or state.serve != "fastest" or state.prefill_identity is None
                or not can_time(self.device)):
            return forward(True)
        key = (f"prefill-model|{device_key(self.device)}|{state.prefill.method}|{state.prefill_identity}"
               f"|B{b}|T{length_bucket(t)}")
        return state.prefill_guard.run(key, forward, state.prefill_chooser)

    @torch.inference_mode()
    def decode(self, steps: int, times: StepTimes | None = None) -> torch.Tensor:
        """``steps`` more greedy tokens after :meth:`prefill` (or an earlier decode); ``[B, steps]``.

        ``times`` (CUDA): device time of each replayed step and host time to issue it; captures are
        timed separately.
        """
        out = torch.empty(self.cache.batch, steps, dtype=torch.long, device=self.device)
        for i in range(steps):
            valid = self._longest + 1  # keys in the longest row at this step
            if valid > self.cache.max_len:
                raise ValueError(f"the cache holds {self.cache.max_len} positions; generation ran past it")
            view = round_up(valid, self.bucket)
            out[:, i:i + 1].copy_(self.token)
            if self.graphs:
                if view != self._graph_view:
                    self._graph_at(view, times)
                self._replay(times)
            else:
                self._eager_step(view, times)
            self._shortest += 1
            self._longest += 1
        return out

    def _eager_step(self, view: int, times: StepTimes | None) -> None:
        """One step without CUDA graphs: the view brought first when it changed, compiles counted."""
        first_at_view = view != self.cache.view
        if first_at_view:
            self._before_view(view, times)
        frames, t0 = frames_compiled(), time.perf_counter()
        with self._decoding(view):
            self._step()
        if first_at_view and times is not None:
            times.add_compiles(frames, (time.perf_counter() - t0) * 1e3)

    def _replay(self, times: StepTimes | None) -> None:
        if times is None:
            self._graph.replay()
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        self._graph.replay()
        end.record()
        times.host_ms.append((time.perf_counter() - t0) * 1e3)
        end.synchronize()
        times.step_ms.append(start.elapsed_time(end))

    def generate(self, input_ids: "torch.Tensor | Sequence[Sequence[int]]", max_new_tokens: int, times: StepTimes | None = None
                 ) -> torch.Tensor:
        """Greedy continuation ``[B, max_new_tokens]`` of ``input_ids [B, T]`` (first token from prefill)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        # input_ids: [B, T], or rows of different lengths (prefill)
        if self.device.type == "cuda" and times is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.prefill(input_ids)
            end.record()
            end.synchronize()
            times.prefill_ms = start.elapsed_time(end)
        else:
            self.prefill(input_ids)
        return self.decode(max_new_tokens, times)


def eager_generate(model: Any, input_ids: torch.Tensor, max_new_tokens: int,
                   on_step: Callable[[int], None] | None = None) -> torch.Tensor:
    """Greedy continuation with transformers' own ``DynamicCache`` and eager calls: ``[B, max_new_tokens]``.

    The reference the static path is checked against (and what ``hf.apply`` users get by default).
    """
    cache = DynamicCache(config=model.config) if _takes(DynamicCache.__init__, "config") else DynamicCache()
    arg = cache_argument(model)
    ids = input_ids
    out = []
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{arg: cache}).logits
        for i in range(max_new_tokens):
            tok = logits[:, -1].argmax(-1, keepdim=True)
            out.append(tok)
            if on_step is not None:
                on_step(i)
            if i + 1 == max_new_tokens:
                break
            logits = model(input_ids=tok, use_cache=True, logits_to_keep=1, **{arg: cache}).logits
    return torch.cat(out, 1)


def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def cache_argument(model: Any) -> str:
    """The keyword a transformers model's ``forward`` takes its cache by: ``cache`` in recent 5.x
    releases, ``past_key_values`` before (and still accepted, deprecated, after)."""
    return "cache" if _takes(model.forward, "cache") else "past_key_values"


def output_cache(out: Any) -> Any:
    """The cache a transformers forward returned: ``out.cache`` in recent 5.x releases (where
    ``past_key_values`` is a deprecated alias, to be removed), ``out.past_key_values`` before."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 cache_len: torch.Tensor | None) -> torch.Tensor | None:
    """Dense decode attention by split-K flash-decoding (the SAAP kernel's dense-layer path,
    :func:`runtime_kernels.saap.triton.saap_sparse_attention_triton` with no buckets), reading the
    valid length ``cache_len [B]`` on the device: ``q [B, Hq, 1, D]``, ``k, v [B, Hkv, T, D]`` ->
    ``[B, Hq, 1, D]``; None on CPU or without Triton.

    Why not SDPA: on a static cache SDPA needs a mask over the view, and transformers then expands
    K/V to every query head (a copy of the whole cache per layer and step) before a masked kernel,
    which at long lengths costs several times the attention itself. Static-cache steps of the dense layers of a method
    (SAAP's layer 0) and the dense baseline of ``scripts/bench/bench_generate.py`` run this instead."""
    if not q.is_cuda:
        return None
    try:  # triton is optional (CPU-only installs): imported at the first CUDA call
        from runtime_kernels.saap.triton import saap_sparse_attention_triton
    except ImportError:
        return None
    return saap_sparse_attention_triton(q[:, :, 0], k, v, None, None, 0, 0, scale, cache_len)[:, :, None]


class FlashDecode:
    """Dense decode attention as a decode runtime (:func:`flash_decode`): the dense baseline of a
    static-cache serving loop. ``decode`` returns None (the model's attention) where it cannot run."""

    method = "dense"
    phase = "decode"
    reads_request_state = False  # a step reads the cache and the weights only: its graphs serve every request

    def observe_prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Any) -> None:
        """Nothing to build."""

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               ctx: Any) -> torch.Tensor | None:
        """``q [B, Hq, 1, D]``, ``k, v [B, Hkv, T, D]`` -> ``[B, Hq, 1, D]``."""
        return flash_decode(q, k, v, scale, getattr(ctx, "cache_len", None))
