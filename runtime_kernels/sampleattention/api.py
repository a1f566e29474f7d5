"""Public SampleAttention prefill entry points: bucket lookup -> two-stage selection -> block-sparse attention.

:class:`SampleAttentionPrefill` is the runtime object ``runtime_kernels.hf.apply`` builds from an
artifact (``hf.RUNTIMES["sampleattention"]``); the functions below are its stateless core.

The selection runs :mod:`runtime_kernels.sampleattention.triton` on CUDA (when it imports; no host sync,
the Stage-1 reductions in Triton) and the PyTorch reference (:mod:`runtime_kernels.sampleattention.reference`)
otherwise; ``backend="reference"`` / ``"triton"`` force one. The attention itself goes through
:func:`runtime_kernels.blocksparse.api.block_sparse_attention`, which dispatches the same way.
"""

from __future__ import annotations

import functools
import importlib
import math
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

import torch
import torch.nn.functional as F

from runtime_kernels.blocksparse.api import Backend, block_sparse_attention
from runtime_kernels.blocksparse.mask import BlockMask
from runtime_kernels.errors import ArtifactError
from runtime_kernels.ragged import padded_rows, rows_alone
from runtime_kernels.sampleattention import reference
from runtime_kernels.sampleattention.buckets import BucketRow, BucketTable
from runtime_kernels.sampleattention.reference import cumulative_residual_attention, sampled_query_rows


@functools.lru_cache(maxsize=1)
def _triton_module() -> ModuleType | None:
    try:
        return importlib.import_module("runtime_kernels.sampleattention.triton")
    except ImportError:
        return None


def _selection_impl(q: torch.Tensor, backend: str) -> ModuleType:
    """The selection module for ``backend``: the Triton one for ``"triton"``, or ``"auto"``/``"masked"`` on
    CUDA when it imports; the reference otherwise."""
    if backend == "reference":
        return reference
    if backend == "triton":
        if _triton_module() is None:
            raise RuntimeError("backend='triton' requested but runtime_kernels.sampleattention.triton (or triton) "
                               "is not importable; install triton or use backend='reference'")
        return _triton_module()
    return _triton_module() if q.is_cuda and _triton_module() is not None else reference


def _select(q: torch.Tensor, k: torch.Tensor, row: BucketRow, blk: int, scale: float | None,
            backend: str = "auto") -> BlockMask:
    return _selection_impl(q, backend).sampleattention_select(q, k, alpha_c=row.alpha_c, alpha_s=row.alpha_s,
                                                              chunk_n=row.chunk_n, blk=blk, scale=scale)


def sampleattention_prefill_mask(
    q: torch.Tensor, k: torch.Tensor, table: BucketTable, *, scale: float | None = None
) -> BlockMask:
    """Mask for one layer's prefill: the row of the bucket holding ``Sk`` (the prompt length).

    ``q: [B, Hq, Sq, D]``, ``k: [B, Hkv, Sk, D]`` -> :class:`BlockMask` over ``[B, Hq]``, blocks
    ``table.blk`` (Triton selection on CUDA, the reference elsewhere).
    """
    return _select(q, k, table.lookup(k.shape[2]), table.blk, scale)


def sampleattention_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: BucketTable,
    *,
    scale: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """SampleAttention prefill: ``q: [B, Hq, Sq, D]``, ``k: [B, Hkv, Sk, D]``, ``v: [B, Hkv, Sk, Dv]``
    -> ``[B, Hq, Sq, Dv]`` (causal; queries are the last ``Sq`` positions)."""
    mask = _select(q, k, table.lookup(k.shape[2]), table.blk, scale, backend)
    return block_sparse_attention(q, k, v, mask, scale=scale, backend=backend)


# ------------------------------------------------------------------------------------------------
# CPU path: the block-sparse semantics through the fused dense kernel with an element mask

_MASKED_MAX_SCORES = 1 << 24  # score elements materialized per chunk of query rows


def masked_dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, *, scale: float | None = None
) -> torch.Tensor:
    """Exactly :func:`runtime_kernels.blocksparse.reference.block_sparse_attention`'s output (softmax
    over the mask's kept causal elements; a row with none gets 0), computed by the fused SDPA kernel
    with a boolean element mask, per chunk of whole query blocks against their causal key prefix.

    Its cost does not shrink with sparsity, but on CPU it beats gathering key blocks, so the runtime uses
    it there (``backend="masked"``, the ``"auto"`` choice on CPU; docs/results/kernels.md). ``q: [B, Hq, Tq, D]``,
    ``k: [B, Hkv, Tk, D]``, ``v: [B, Hkv, Tk, Dv]`` -> ``[B, Hq, Tq, Dv]`` in ``q.dtype``.
    """
    b, hq, tq, d = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[-1]
    if (mask.batch, mask.heads, mask.seq_q, mask.seq_k) != (b, hq, tq, tk) or hq % hkv:
        raise ValueError(f"mask (B, H, Sq, Sk)={(mask.batch, mask.heads, mask.seq_q, mask.seq_k)} does not fit "
                         f"q {tuple(q.shape)} / k {tuple(k.shape)}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    keep = mask.to(q.device).to_dense()  # [B, Hq, NQ, NK]
    bq, bk = mask.block_q, mask.block_k
    step = bq * max(1, _MASKED_MAX_SCORES // max(1, b * hq * tk * bq))  # rows per chunk, whole query blocks
    out = torch.full((b, hq, tq, dv), math.nan, dtype=q.dtype, device=q.device)  # every row is written below
    kk, vv = k.to(cdt), v.to(cdt)
    for r0 in range(0, tq, step):
        r1 = min(tq, r0 + step)
        k_end = tk - tq + r1  # keys visible to the chunk's last query
        qpos = torch.arange(r0, r1, device=q.device) + (tk - tq)  # [r] absolute positions
        kpos = torch.arange(k_end, device=q.device)
        blocks = keep[:, :, r0 // bq : -(-r1 // bq), : -(-k_end // bk)]  # [B, Hq, nqb, nkb]
        nqb, nkb = blocks.shape[2:]
        allowed = blocks[:, :, :, None, :, None].expand(b, hq, nqb, bq, nkb, bk).reshape(b, hq, nqb * bq, nkb * bk)
        allowed = allowed[:, :, : r1 - r0, :k_end] & (kpos[None, :] <= qpos[:, None])  # [B, Hq, r, Kc]
        o = F.scaled_dot_product_attention(q[:, :, r0:r1].to(cdt), kk[:, :, :k_end], vv[:, :, :k_end],
                                           attn_mask=allowed, scale=scale, enable_gqa=hq != hkv)
        # a row with no kept causal key gets 0 (as the reference): its first kept key lies after it
        first = torch.where(blocks, torch.arange(nkb, device=q.device), nkb).amin(-1) * bk  # [B, Hq, nqb]
        empty = first.repeat_interleave(bq, -1)[..., : r1 - r0] > qpos  # [B, Hq, r]
        out[:, :, r0:r1] = o.masked_fill(empty[..., None], 0.0).to(q.dtype)
    return out


# ------------------------------------------------------------------------------------------------
# The runtime object ``runtime_kernels.hf`` plugs into a model


def _device_sum(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """``total + value.sum()`` in float64, left on ``value``'s device (no host sync)."""
    part = value.double().sum()
    return part if total is None else total + part


@dataclass
class _Stats:
    """Running sums over the prefill calls (layers x prompts) since the last :meth:`pop_stats`. Measured
    values stay on the device, summed there, and are read once per pop (no host sync per layer); a dense
    row's density and CRA are 1 per head, counted here. Timed calls on CUDA record event pairs, read at the
    pop; on the CPU the host clock times them."""

    calls: int = 0
    heads: int = 0  # (batch, head) entries summed below
    dense_heads: int = 0  # of them, in dense rows (density and CRA 1)
    density: torch.Tensor | None = None  # sparse rows' summed density, float64 on the device
    cra: torch.Tensor | None = None  # the same for the sampled CRA
    cra_min: torch.Tensor | None = None
    time_s: float = 0.0  # host-clocked (CPU) attention time
    events: list[tuple[Any, Any]] = field(default_factory=list)  # CUDA (start, end) of each timed call
    bucket: int = -1

    def add(self, heads: int, density: torch.Tensor | None, cra: torch.Tensor | None, bucket: int) -> None:
        """A call over ``heads`` (batch, head) entries: ``density, cra: [B, H]`` measured, or ``density``
        None for a dense row; ``cra`` None when not measured."""
        self.calls += 1
        self.heads += heads
        self.bucket = bucket
        if density is None:
            self.dense_heads += heads
            return
        self.density = _device_sum(self.density, density)
        if cra is not None:
            self.cra = _device_sum(self.cra, cra)
            low = cra.min()
            self.cra_min = low if self.cra_min is None else torch.minimum(self.cra_min, low)

    def summary(self, report_cra: bool, timing: bool) -> dict[str, float]:
        """The means over every (call, batch, head); ``{}`` when nothing ran."""
        if self.calls == 0:
            return {}
        measured = 0.0 if self.density is None else float(self.density)
        density = (measured + self.dense_heads) / self.heads
        out = {"density": density, "sparsity": 1.0 - density, "bucket": float(self.bucket)}
        if report_cra:
            cra = 0.0 if self.cra is None else float(self.cra)
            lows = ([float(self.cra_min)] if self.cra_min is not None else []) + ([1.0] if self.dense_heads else [])
            out.update(cra=(cra + self.dense_heads) / self.heads, cra_min=min(lows, default=math.inf))
        if timing:
            if self.events:
                self.events[-1][1].synchronize()
            out["attn_time_s"] = self.time_s + sum(a.elapsed_time(b) for a, b in self.events) / 1e3
        return out


class SampleAttentionPrefill:
    """SampleAttention in prefill: per call, the bucket row of the prompt length -> mask -> attention.

    Built from an artifact (:meth:`from_artifact`, the bucket table of the manifest payload) or
    directly from a :class:`BucketTable` or one fixed :class:`BucketRow` (calibration scores grid
    points this way). A dense row (either alpha 1) returns ``None`` so the model's own attention runs,
    except with ``timing`` where dense SDPA runs here so that its time is measured like a sparse call.

    Statistics (``stats``; :meth:`pop_stats`, per prompt in ``calib eval``): mean block ``density`` and
    ``sparsity = 1 - density`` over every (layer, batch, head) of the calls since the last pop, the
    mean and minimum sampled CRA (``cra``, ``cra_min``: exact kept softmax mass on the Stage-1 sampled
    query rows, 1 for dense rows; computed outside the timed region, only with ``report_cra``), the
    bucket index of the last call, and with ``timing`` the summed attention time ``attn_time_s``
    (selection + attention: CUDA events on GPU, the host clock on CPU). They are summed on the device and
    read at :meth:`pop_stats`: no call synchronizes with the host.
    """

    method = "sampleattention"
    phase = "prefill"
    ragged_prefill = True  # takes rows padded after their last token (``ctx.lengths``), each row as alone

    def __init__(self, table: BucketTable | BucketRow, *, blk: int = 64, report_cra: bool = True,
                 timing: bool = False, backend: Backend | Literal["masked"] = "auto", stats: bool = True) -> None:
        if backend not in ("auto", "masked", "reference", "triton"):
            raise ValueError(f"unknown backend {backend!r}; use auto, masked, reference or triton")
        if isinstance(table, BucketRow):
            table = BucketTable([], [table], blk=blk)
        self.table = table
        self.report_cra = report_cra and stats  # the CRA is a statistic: none without them
        self.timing = timing
        self.backend = backend
        self.stats = stats
        self._stats = _Stats()

    @classmethod
    def from_artifact(cls, artifact: Any, model: Any = None, *, stats: bool = False) -> "SampleAttentionPrefill":
        """The runtime of a ``sampleattention`` artifact: ``payload["buckets"]`` (checked against the
        ``table`` tensor ``[n_buckets, 3]`` = (alpha_c, alpha_s, chunk_n) when the artifact has one).
        ``stats`` is off for serving (``hf.apply``'s default): the statistics (density, and the sampled
        CRA: one more softmax pass) sync with the host in every layer; ``calib eval`` turns them on."""
        buckets = artifact.manifest.payload.get("buckets")
        if not isinstance(buckets, dict):
            raise ArtifactError(f"{artifact.path}: SampleAttention artifact has no bucket table "
                                "(payload.buckets); re-run `python -m calib run +method=sampleattention`")
        try:
            table = BucketTable.from_dict(buckets)
        except ValueError as err:
            raise ArtifactError(f"{artifact.path}: {err}") from None
        tensor = artifact.tensors.get("table")
        if tensor is not None:
            expected = bucket_table_tensor(table)
            if tuple(tensor.shape) != tuple(expected.shape) or not torch.allclose(tensor.float(), expected, atol=1e-6):
                raise ArtifactError(f"{artifact.path}: tensor 'table' {tuple(tensor.shape)} disagrees with "
                                    "payload.buckets (edited manifest?); re-run the calibration")
        return cls(table, stats=stats)

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                ctx: Any = None) -> torch.Tensor | None:
        """``q: [B, Hq, T, D]``, ``k, v: [B, Hkv, T, D]`` -> ``[B, Hq, T, D]``, or None (run dense).
        With ``ctx.lengths`` (rows padded after their last token) each row runs alone
        (:mod:`runtime_kernels.ragged`)."""
        lengths = padded_rows(ctx, q)
        if lengths is not None:
            return rows_alone(self.prefill, layer, q, k, v, scale, lengths)
        length = k.shape[2]
        bucket = self.table.bucket_index(length)
        row = self.table.lookup(length)
        b, hq = q.shape[:2]
        start = self._clock(q)
        if row.dense:
            out = None
            if self.timing:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
                self._stop(q, start)
            if self.stats:
                self._stats.add(b * hq, None, None, bucket)
            return out
        row_mass = None
        if self.report_cra and not self.timing and _selection_impl(q, self.backend) is reference:
            # the reference's Stage 1 keeps each sampled row's per-block mass: the CRA needs no second softmax
            column, slash, row_mass = reference.stage1_row_reductions(q, k, chunk_n=row.chunk_n, blk=self.table.blk,
                                                                      scale=scale)
            mask = reference.stage2_select(column, slash, row.alpha_c, row.alpha_s, k.shape[2], self.table.blk,
                                           seq_q=q.shape[2])
        else:
            mask = _select(q, k, row, self.table.blk, scale, self.backend)
        out = self._attend(q, k, v, mask, scale)
        if self.timing:
            self._stop(q, start)
        if not self.stats:
            return out
        cra = None
        if self.report_cra:
            rows = sampled_query_rows(q.shape[2], row.chunk_n, self.table.blk, q.device)
            cra = (reference.sampled_cra(mask, rows, row_mass) if row_mass is not None
                   else cumulative_residual_attention(q, k, mask, rows, scale=scale))
        self._stats.add(b * hq, mask.density(), cra, bucket)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, scale: float) -> torch.Tensor:
        """``backend``: ``"masked"`` (:func:`masked_dense_attention`), ``"reference"``/``"triton"``
        (:func:`block_sparse_attention`); ``"auto"`` = masked on CPU, the block-sparse dispatch on CUDA."""
        if self.backend == "masked" or (self.backend == "auto" and not q.is_cuda):
            return masked_dense_attention(q, k, v, mask, scale=scale)
        return block_sparse_attention(q, k, v, mask, scale=scale, backend=self.backend)

    def _clock(self, q: torch.Tensor) -> Any:
        """The start of a timed call: a recorded CUDA event, or the host clock (CPU); None untimed."""
        if not self.timing:
            return None
        if q.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _stop(self, q: torch.Tensor, start: Any) -> None:
        """End the timed call begun at ``start`` (:meth:`_clock`)."""
        if q.is_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._stats.events.append((start, end))
        else:
            self._stats.time_s += time.perf_counter() - start

    def pop_stats(self) -> dict[str, float]:
        """Statistics since the last call (see the class docstring); ``{}`` when nothing ran."""
        s, self._stats = self._stats, _Stats()
        return s.summary(self.report_cra, self.timing)


def bucket_table_tensor(table: BucketTable) -> torch.Tensor:
    """``[n_buckets, 3]`` float32 rows ``(alpha_c, alpha_s, chunk_n)``: the artifact's hashed copy of the table."""
    return torch.tensor([[r.alpha_c, r.alpha_s, float(r.chunk_n)] for r in table.rows], dtype=torch.float32)
