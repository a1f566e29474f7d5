"""SAAP decode attention, plain PyTorch: the definition of correct (Mazaré et al., arXiv:2502.08246, §4-§5, App. F).

One decode step of one layer. The cache holds ``T`` keys (the current token's key is the last one);
the single query of each head sits at position ``T - 1``. Keys split into:

* the **dense region**: the first ``sink`` positions plus the ``recent`` most recent ones
  (``[0, sink) ∪ [T - recent, T)``; "1+2047" for Llama-3.1, so the config value ``window = sink + recent``);
* the **bucket candidates**: every other key, positions ``[sink, T - recent)`` (:func:`searchable_range`).

Each key is assigned at arrival to its nearest (L2) k-means centroid of its KV head, computed on the
de-RoPE'd key. Each query head's MLP classifier maps the de-RoPE'd query to a distribution over the
``C`` buckets; the ``G`` query heads of a GQA group sum their probabilities and the group visits the ``ℓ``
highest buckets (all ``ℓ``: the paper's Alg. 2 guard ``ℓ > b_i > 0`` skips the last one, we do not).
Attention is computed exactly (RoPE'd ``q·k``) over the dense region (one partial) and over *all* keys
of each visited bucket (one partial per bucket), and the ``ℓ + 1`` partials are merged by log-sum-exp.

:class:`BucketIndex` holds only bucket candidates, so the dense part and the bucket part never overlap
and a kernel needs no window test: when a key leaves the recent window it is inserted in its bucket
(its bucket id was recorded when it arrived, from the de-RoPE'd key, which is not kept).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from runtime_kernels.rope import derope_at

_ASSIGN_BUDGET = 1 << 24  # elements of one [..., chunk, C] distance buffer in the nearest-centroid search
_ASSIGN_BUDGET_CUDA = 1 << 26  # ... on a GPU: fewer, larger launches (an index build is launch-bound)


# --------------------------------------------------------------------------------------------------
# Calibrated parameters of one layer
# --------------------------------------------------------------------------------------------------


@dataclass
class SaapLayerParams:
    """What SAAP calibrated for one layer (``dense=True``: plain attention, no other tensor needed).

    Classifier ``h``: ``logits = relu(bn(q @ w1[h] + b1[h])) @ w2[h] + b2[h]`` with
    ``bn(x) = (x - bn_mean[h]) / sqrt(bn_var[h] + bn_eps) * bn_weight[h] + bn_bias[h]`` (eval mode).
    There are ``Hc`` classifiers, ``Hc`` a multiple of ``Hkv`` dividing ``Hq``: one per query head
    (``Hc = Hq``), or one per KV head (``Hc = Hkv``) applied to each of the group's queries, the paper's
    batched search (arXiv:2502.08246, §5: ``Σᵢ f_q(qᵢ)`` as one matrix-matrix product). Query head ``h``
    uses classifier ``h // (Hq / Hc)``.
    """

    sink: int  # leading positions always attended densely (1)
    recent: int  # most recent positions attended densely (window - sink; 2047 for llama31)
    dense: bool = False  # layer 0 in the paper: plain attention
    centroids: torch.Tensor | None = None  # [Hkv, C, D] float32, k-means on de-RoPE'd keys
    w1: torch.Tensor | None = None  # [Hc, D, Hd]
    b1: torch.Tensor | None = None  # [Hc, Hd]
    bn_mean: torch.Tensor | None = None  # [Hc, Hd] running mean
    bn_var: torch.Tensor | None = None  # [Hc, Hd] running variance
    bn_weight: torch.Tensor | None = None  # [Hc, Hd]
    bn_bias: torch.Tensor | None = None  # [Hc, Hd]
    w2: torch.Tensor | None = None  # [Hc, Hd, C]
    b2: torch.Tensor | None = None  # [Hc, C]
    bn_eps: float = 1e-5

    TENSOR_FIELDS = ("centroids", "w1", "b1", "bn_mean", "bn_var", "bn_weight", "bn_bias", "w2", "b2")

    def __post_init__(self) -> None:
        if self.sink < 0 or self.recent < 0 or self.sink + self.recent < 1:
            raise ValueError(f"SAAP dense region needs sink >= 0, recent >= 0, sink + recent >= 1; "
                             f"got sink={self.sink}, recent={self.recent}")
        if self.dense:
            return
        missing = [n for n in self.TENSOR_FIELDS if getattr(self, n) is None]
        if missing:
            raise ValueError(f"SAAP layer is not dense but lacks tensors {missing}")
        hkv, c, d = self.centroids.shape
        hc, d1, hd = self.w1.shape
        if d1 != d or self.w2.shape != (hc, hd, c) or hc % hkv:
            raise ValueError(f"SAAP tensor shapes disagree: centroids {tuple(self.centroids.shape)}, "
                             f"w1 {tuple(self.w1.shape)}, w2 {tuple(self.w2.shape)}")

    @property
    def num_clusters(self) -> int:
        return int(self.centroids.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def num_classifiers(self) -> int:
        """``Hc``: one classifier per query head, or one per KV head (class docstring)."""
        return int(self.w1.shape[0])

    def to_tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Flat ``{prefix + name: tensor}`` for safetensors (empty for a dense layer)."""
        if self.dense:
            return {}
        return {prefix + n: getattr(self, n).contiguous() for n in self.TENSOR_FIELDS}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], *, sink: int, recent: int, dense: bool = False,
                     bn_eps: float = 1e-5, prefix: str = "") -> "SaapLayerParams":
        """Inverse of :meth:`to_tensors`."""
        if dense:
            return cls(sink=sink, recent=recent, dense=True, bn_eps=bn_eps)
        return cls(sink=sink, recent=recent, bn_eps=bn_eps, **{n: tensors[prefix + n] for n in cls.TENSOR_FIELDS})

    def to(self, device: torch.device | str, weight_dtype: torch.dtype | None = None) -> "SaapLayerParams":
        """A copy on ``device``; ``weight_dtype`` also converts the classifier's ``w1, w2`` (the rest keep
        their dtype: centroids, biases and batch-norm statistics are small and stay float32)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        for n in self.TENSOR_FIELDS:
            if kw[n] is not None:
                kw[n] = kw[n].to(device, dtype=weight_dtype if weight_dtype is not None and n in ("w1", "w2") else None)
        return SaapLayerParams(**kw)


# --------------------------------------------------------------------------------------------------
# Key assignment
# --------------------------------------------------------------------------------------------------


def searchable_range(seq_len: int, sink: int, recent: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` that are bucket candidates in a cache of ``seq_len`` keys (may be empty)."""
    lo = min(sink, seq_len)
    return lo, max(lo, seq_len - recent)


def dense_region(index: "BucketIndex", params: SaapLayerParams) -> tuple[int, int]:
    """``(lo, hi)``: a decode step attends ``[0, lo) ∪ [hi, T)`` densely and the rest through buckets.

    ``hi`` is where the index's lists end. An index kept up to date every step (the eager path) ends
    them at ``T - recent``; one brought up to date only now and then (the static-cache path) lags,
    and the keys that left the window since are attended with it, exactly.
    """
    return min(params.sink, index.searchable_hi), index.searchable_hi


def check_index_fits(index: "BucketIndex | None", t: int, params: SaapLayerParams) -> None:
    """Refuse an index that covers keys the cache lacks, or lists keys still inside the window."""
    if index is None or index.length > t or index.searchable_hi > searchable_range(t, params.sink, params.recent)[1]:
        got = None if index is None else f"{index.length} keys (lists end at {index.searchable_hi})"
        raise ValueError(f"bucket index covers {got}, which does not fit a cache of {t} keys")


def nearest_centroid(x: torch.Tensor, centroids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Nearest centroid in L2: ``x: [..., N, D]``, ``centroids: [..., C, D]`` -> ``[..., N]`` int64.

    Leading dims broadcast (one codebook per head: ``x [H, N, D]`` with ``centroids [H, C, D]``).
    ``argmin ||x - c||² = argmin (||c||² - 2 x·c)``, computed in float32, ``chunk`` rows at a time
    (default: as many as keep the distance buffer at 16M elements, 64M on a GPU).
    """
    c = centroids.float()
    if chunk is None:
        per_row = math.prod(torch.broadcast_shapes(x.shape[:-2], c.shape[:-2])) * c.shape[-2]
        chunk = max(1, (_ASSIGN_BUDGET_CUDA if x.is_cuda else _ASSIGN_BUDGET) // max(1, per_row))
    c_sq = (c * c).sum(-1).unsqueeze(-2)  # [..., 1, C]
    out = []
    for start in range(0, x.shape[-2], chunk):
        xc = x[..., start:start + chunk, :].float()
        d = c_sq - 2.0 * (xc @ c.transpose(-1, -2))  # [..., n, C]
        out.append(d.argmin(-1))
    if not out:
        return torch.zeros(x.shape[:-1], dtype=torch.int64, device=x.device)
    return torch.cat(out, -1)


# --------------------------------------------------------------------------------------------------
# Bucket index (decode state of one layer)
# --------------------------------------------------------------------------------------------------


def slots_bound(candidates: int, clusters: int, slack: float, min_slack: int) -> int:
    """The most slots a layout of ``candidates`` keys over ``clusters`` buckets takes: each bucket gets
    ``count + ceil(slack·count) + min_slack``, summed at most ``N·(1 + slack) + C·(1 + min_slack)``."""
    return math.ceil(candidates * (1 + slack)) + clusters * (1 + min_slack)


def _grouped_by_bucket(kb: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys ``kb [..., n]`` (bucket ids; ``counts [..., C]`` their per-bucket counts) grouped by bucket by a
    stable sort, so positions stay ascending inside a bucket: ``(order, bucket of each, rank inside it)``."""
    order = torch.sort(kb, dim=-1, stable=True).indices
    sorted_b = kb.gather(-1, order)
    first = torch.cumsum(counts, -1) - counts  # where each bucket's run starts in the sorted order
    return order, sorted_b, torch.arange(kb.shape[-1], device=kb.device) - first.gather(-1, sorted_b)


def _layout(kb: torch.Tensor, c: int, slack: float, min_slack: int, lo: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slot layout of candidates ``kb [..., N]`` (bucket ids, int64, of positions ``lo, lo + 1, ...``):
    each bucket gets ``count + ceil(slack · count) + min_slack`` slots. Returns ``(counts [..., C] int64,
    start [..., C + 1] int64, dest [..., N]`` (each key's slot), ``positions [..., N]`` int32 (what the
    slots hold)). Leading dims are independent indexes (one layer's ``[B, Hkv]``, or several layers')."""
    lead = kb.shape[:-1]
    counts = torch.zeros(*lead, c, dtype=torch.int64, device=kb.device)
    counts.scatter_add_(-1, kb, torch.ones_like(kb))
    cap = counts + torch.ceil(counts.float() * slack).long() + min_slack
    start = torch.zeros(*lead, c + 1, dtype=torch.int64, device=kb.device)
    start[..., 1:] = torch.cumsum(cap, -1)
    order, sorted_b, rank = _grouped_by_bucket(kb, counts)
    return counts, start, start.gather(-1, sorted_b) + rank, (order + lo).to(torch.int32)


def _grow(t: torch.Tensor, need: int, dim: int = -1, fill: int = 0) -> torch.Tensor:
    """Return ``t`` with at least ``need`` entries along ``dim`` (capacity doubles, amortized O(1))."""
    have = t.shape[dim]
    if need <= have:
        return t
    shape = list(t.shape)
    shape[dim] = max(need, 2 * have, 16)
    out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    out.narrow(dim, 0, have).copy_(t)
    return out


@dataclass
class BucketIndex:
    """Inverted lists of the bucket candidates of one layer, for ``B`` sequences and ``Hkv`` KV heads.

    All sequences of the batch share the cache length ``T`` (no padding support in the reference).

    Storage, read by a kernel per ``(b, h, c)`` (CSR with slack so that decode appends are O(1)):
    bucket ``c`` of ``(b, h)`` is ``slots[b, h, slot_start[b, h, c] : slot_start[b, h, c] + bucket_count[b, h, c]]``,
    key positions in ascending order; ``slot_start[..., c + 1] - slot_start[..., c]`` is the bucket's capacity.
    With no slack (``slack=0`` and no append yet) ``slot_start`` *is* the packed CSR offsets. :meth:`csr`
    returns the packed form ``(offsets [B, Hkv, C+1], indices [B, Hkv, N_s])`` whatever the slack.

    ``key_bucket[b, h, t]`` is the bucket of every key of the cache (``-1`` for sink positions), recorded
    when the key arrives, because the de-RoPE'd key is not kept. Only positions in
    :func:`searchable_range` are in the inverted lists.

    A layout gives every bucket ``ceil(slack · count) + min_slack`` free slots; a decode append writes
    one slot per (b, h) and, only when some bucket is full, lays everything out again (``O(N)``, rare:
    capacity grows with the bucket, so appends are amortized ``O(1)``).
    """

    centroids: torch.Tensor  # [Hkv, C, D] float32 (a reference to the layer's centroids)
    sink: int
    recent: int
    length: int  # T, keys in the cache
    key_bucket_buf: torch.Tensor  # [B, Hkv, T_cap] int32, valid [..., :length]
    slot_start: torch.Tensor  # [B, Hkv, C + 1] int32
    bucket_count: torch.Tensor  # [B, Hkv, C] int32
    slots: torch.Tensor  # [B, Hkv, S] int32 key positions (S >= slot_start[..., -1])
    searchable_hi: int  # positions [sink, searchable_hi) are in the lists
    slack: float = 0.25  # extra capacity per bucket at (re)layout: ceil(slack * count) + min_slack
    min_slack: int = 4
    repacks: int = field(default=0)  # how many times the slot layout was rebuilt (for tests and logs)
    fixed: bool = False  # the lists live in preallocated storage, laid out in place (from_assignments)

    # ----------------------------------------------------------------------------------------- build
    @classmethod
    def build(cls, keys_derope: torch.Tensor, centroids: torch.Tensor, *, sink: int, recent: int,
              slack: float = 0.25, min_slack: int = 4) -> "BucketIndex":
        """Index a prefilled cache. ``keys_derope: [B, Hkv, T, D]``, ``centroids: [Hkv, C, D]``."""
        b, hkv, t, _ = keys_derope.shape
        if centroids.shape[0] != hkv or centroids.shape[-1] != keys_derope.shape[-1]:
            raise ValueError(f"centroids {tuple(centroids.shape)} do not fit keys {tuple(keys_derope.shape)}")
        return cls.from_assignments(cls._assign(keys_derope, centroids, 0, sink), centroids, sink=sink, recent=recent,
                                    slack=slack, min_slack=min_slack)

    @classmethod
    def from_assignments(cls, kb: torch.Tensor, centroids: torch.Tensor, *, sink: int, recent: int,
                         slack: float = 0.25, min_slack: int = 4,
                         storage: "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None" = None) -> "BucketIndex":
        """Index a prefilled cache from its keys' bucket ids ``kb [B, Hkv, T]`` int32 (-1 for the sink),
        e.g. assigned a chunk of positions at a time to bound memory.

        ``storage`` (:meth:`storage_for`): ``slot_start, bucket_count, slots`` to lay the lists out in,
        in place, now and at every later relayout: their addresses never change, so a CUDA graph that
        read them serves any later index built into them."""
        idx = cls._unlaid(kb, centroids, sink, recent, slack, min_slack, storage)
        idx._relayout(searchable_range(kb.shape[-1], sink, recent)[1])
        return idx

    @classmethod
    def _unlaid(cls, kb: torch.Tensor, centroids: torch.Tensor, sink: int, recent: int, slack: float, min_slack: int,
                storage: "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None") -> "BucketIndex":
        """An index of assignments ``kb [B, Hkv, T]`` in ``storage`` (or new empty lists), not laid out yet."""
        b, hkv, t = kb.shape
        c = centroids.shape[1]
        if storage is None:
            storage = (torch.zeros(b, hkv, c + 1, dtype=torch.int32, device=kb.device),
                       torch.zeros(b, hkv, c, dtype=torch.int32, device=kb.device),
                       torch.zeros(b, hkv, 0, dtype=torch.int32, device=kb.device))
        elif storage[0].shape != (b, hkv, c + 1) or storage[1].shape != (b, hkv, c) or storage[2].shape[:2] != (b, hkv):
            raise ValueError(f"index storage {[tuple(x.shape) for x in storage]} does not fit B={b}, Hkv={hkv}, C={c}")
        return cls(centroids=centroids, sink=sink, recent=recent, length=t, key_bucket_buf=kb,
                   slot_start=storage[0], bucket_count=storage[1], slots=storage[2],
                   searchable_hi=min(sink, t), slack=slack, min_slack=min_slack, fixed=storage[2].shape[-1] > 0)

    @classmethod
    def from_assignments_many(cls, kb: torch.Tensor, centroids: Sequence[torch.Tensor], *, sink: int, recent: int,
                              storages: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None],
                              slack: float = 0.25, min_slack: int = 4) -> "list[BucketIndex]":
        """:meth:`from_assignments` of several layers at once: ``kb [L, B, Hkv, T]`` int32 (one row per
        layer, all with ``C`` buckets and the same sink and recent window), ``centroids`` and ``storages``
        (each :meth:`storage_for`, or None) one per layer. The layouts are computed in one batched pass
        (a few launches for every layer instead of the same few per layer); each layer's index equals
        its own :meth:`from_assignments`. ``kb[l]`` becomes layer ``l``'s ``key_bucket_buf``."""
        n_layers, b, hkv, t = kb.shape
        if len(centroids) != n_layers or len(storages) != n_layers:
            raise ValueError(f"{n_layers} layers of assignments, {len(centroids)} centroids, {len(storages)} storages")
        c = centroids[0].shape[1]
        if any(cent.shape[1] != c for cent in centroids):
            raise ValueError("layers indexed together need the same number of buckets")
        hi = searchable_range(t, sink, recent)[1]
        lo = min(sink, hi)
        counts, start, dest, positions = _layout(kb[..., lo:hi].long(), c, slack, min_slack, lo)
        out = []
        for layer in range(n_layers):
            idx = cls._unlaid(kb[layer], centroids[layer], sink, recent, slack, min_slack, storages[layer])
            idx._write_layout((counts[layer], start[layer], dest[layer], positions[layer]), hi)
            out.append(idx)
        return out

    @staticmethod
    def storage_for(batch: int, kv_heads: int, clusters: int, max_keys: int, device: torch.device,
                    slack: float = 0.25, min_slack: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Preallocated ``slot_start, bucket_count, slots`` (int32) for any index of at most ``max_keys``
        candidates (:func:`slots_bound`)."""
        cap = slots_bound(max_keys, clusters, slack, min_slack)
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int32, device=device)  # noqa: E731
        return z(batch, kv_heads, clusters + 1), z(batch, kv_heads, clusters), z(batch, kv_heads, cap)

    @staticmethod
    def _assign(keys_derope: torch.Tensor, centroids: torch.Tensor, first_pos: int, sink: int) -> torch.Tensor:
        """Bucket ids ``[..., B, Hkv, n]`` int32 of keys ``[..., B, Hkv, n, D]`` at positions ``first_pos ...``
        (centroids ``[..., Hkv, C, D]``: leading dims are several layers, each with its own); sink positions
        get -1."""
        *lead, b, hkv, n, d = keys_derope.shape
        x = keys_derope.transpose(-4, -3).reshape(*lead, hkv, b * n, d)  # [..., Hkv, B*n, D]
        kb = nearest_centroid(x, centroids.to(keys_derope.device)).view(*lead, hkv, b, n).transpose(-3, -2)
        kb = kb.to(torch.int32).contiguous()
        n_sink = max(0, min(n, sink - first_pos))
        kb[..., :n_sink] = -1
        return kb

    @property
    def num_clusters(self) -> int:
        return int(self.bucket_count.shape[-1])

    @property
    def key_bucket(self) -> torch.Tensor:
        """``[B, Hkv, T]`` int32 bucket of every cached key (-1 for the sink)."""
        return self.key_bucket_buf[..., : self.length]

    def _relayout(self, hi: int) -> None:
        """Rebuild the slot layout from ``key_bucket`` for candidates ``[sink, hi)`` (fresh slack)."""
        lo = min(self.sink, hi)
        self._write_layout(_layout(self.key_bucket_buf[..., lo:hi].long(), self.num_clusters, self.slack,
                                   self.min_slack, lo), hi)

    def _write_layout(self, layout: "tuple[torch.Tensor, ...]", hi: int) -> None:
        """Store a :func:`_layout` of candidates ``[sink, hi)``: in place in fixed storage, else in new lists."""
        counts, start, dest, positions = layout
        b, hkv, c = self.bucket_count.shape
        if self.fixed:  # in place: the storage's addresses stay what a captured graph read
            if slots_bound(dest.shape[-1], c, self.slack, self.min_slack) > self.slots.shape[-1]:  # else no sync
                need = int(start[..., -1].max()) if start.numel() else 0
                if need > self.slots.shape[-1]:
                    raise ValueError(f"index storage holds {self.slots.shape[-1]} slots, the layout needs {need}")
            self.slots.scatter_(-1, dest, positions)
            self.slot_start.copy_(start)
            self.bucket_count.copy_(counts)
        else:
            need = int(start[..., -1].max()) if start.numel() else 0
            slots = torch.zeros(b, hkv, need, dtype=torch.int32, device=dest.device)
            slots.scatter_(-1, dest, positions)
            self.slot_start, self.bucket_count, self.slots = start.to(torch.int32), counts.to(torch.int32), slots
        self.searchable_hi = hi
        self.repacks += 1

    # ---------------------------------------------------------------------------------------- append
    def append(self, new_keys_derope: torch.Tensor) -> None:
        """Add ``n`` decoded keys ``[B, Hkv, n, D]`` (de-RoPE'd) at positions ``T .. T+n-1``.

        Each new key gets its bucket now; keys that leave the recent window (positions
        ``[old hi, new hi)``) are appended to their bucket's list. Afterwards the index equals
        :meth:`build` on the whole cache (same ``key_bucket``, same :meth:`csr`).
        """
        n = new_keys_derope.shape[-2]
        kb = self._assign(new_keys_derope, self.centroids, self.length, self.sink)
        self.key_bucket_buf = _grow(self.key_bucket_buf, self.length + n, fill=-1)
        self.key_bucket_buf[..., self.length:self.length + n] = kb
        self.length += n
        hi = searchable_range(self.length, self.sink, self.recent)[1]
        entering = hi - self.searchable_hi
        if entering > max(64, (hi - self.sink) // 8):  # a large chunk: rebuild is cheaper than inserts
            self._relayout(hi)
            return
        lo = max(self.searchable_hi, self.sink)  # an index shorter than the sink lists from it
        if hi > lo:
            self._insert(lo, hi)
        self.searchable_hi = hi

    def _insert(self, lo: int, hi: int) -> None:
        """Append keys ``lo .. hi-1`` (each past every listed position) to the ends of their buckets, for
        every (b, h), all at once: one host sync for the capacity check, whatever the count; a bucket
        that would overflow lays everything out again, with fresh slack."""
        kb = self.key_bucket_buf[..., lo:hi].long()  # [B, Hkv, n]
        add = torch.zeros_like(self.bucket_count, dtype=torch.long).scatter_add_(-1, kb, torch.ones_like(kb))
        cnt = self.bucket_count.long()
        start = self.slot_start.long()
        if bool((cnt + add > start[..., 1:] - start[..., :-1]).any()):
            self._relayout(hi)
            return
        order, sorted_b, rank = _grouped_by_bucket(kb, add)  # each new key after its bucket's listed ones
        dest = start.gather(-1, sorted_b) + cnt.gather(-1, sorted_b) + rank
        self.slots.scatter_(-1, dest, (order + lo).to(torch.int32))
        self.bucket_count.add_(add.to(torch.int32))  # in place: kept storage keeps its address

    # ------------------------------------------------------------------------------------------ read
    def csr(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed CSR: ``offsets [B, Hkv, C+1]`` int32 and ``indices [B, Hkv, N_s]`` int32.

        ``indices[b, h, offsets[b, h, c] : offsets[b, h, c+1]]`` are the positions in bucket ``c``,
        ascending; ``N_s = hi - sink`` is the number of candidates (the same for every ``(b, h)``).
        """
        b, hkv, c = self.bucket_count.shape
        offsets = torch.zeros(b, hkv, c + 1, dtype=torch.int32, device=self.slots.device)
        offsets[..., 1:] = torch.cumsum(self.bucket_count, -1)
        s = torch.arange(self.slots.shape[-1], device=self.slots.device)
        # bucket owning each slot, then keep filled slots only (region order = bucket order)
        owner = torch.searchsorted(self.slot_start[..., 1:].contiguous().long(), s.expand(b, hkv, -1).contiguous(),
                                   right=True)  # [B, Hkv, S]
        filled = (owner < c) & (s - self.slot_start.gather(-1, owner.clamp(max=c - 1)).long()
                                < self.bucket_count.gather(-1, owner.clamp(max=c - 1)).long())
        n_s = self.searchable_hi - min(self.sink, self.searchable_hi)
        return offsets, self.slots[filled].view(b, hkv, n_s)

    def gather_buckets(self, buckets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key positions of the chosen buckets, padded: ``buckets [B, Hkv, L]`` ->
        ``positions [B, Hkv, L, M]`` int64 and ``valid [B, Hkv, L, M]`` bool (``M`` = largest chosen bucket).
        """
        c = buckets.long()
        start = self.slot_start.gather(-1, c).long()  # [B, Hkv, L]
        cnt = self.bucket_count.gather(-1, c).long()
        m = int(cnt.max()) if cnt.numel() else 0
        ar = torch.arange(m, device=c.device)
        valid = ar < cnt.unsqueeze(-1)  # [B, Hkv, L, M]
        slot = torch.where(valid, start.unsqueeze(-1) + ar, 0)
        flat = slot.flatten(2)  # [B, Hkv, L*M]
        pos = self.slots.gather(-1, flat).long().view_as(slot) if self.slots.shape[-1] else torch.zeros_like(slot)
        return torch.where(valid, pos, 0), valid


# --------------------------------------------------------------------------------------------------
# Query classifier and bucket ranking
# --------------------------------------------------------------------------------------------------


def classifier_input(q: torch.Tensor, query_rotation: torch.Tensor, params: SaapLayerParams) -> torch.Tensor:
    """The classifier's input from the RoPE'd query ``q [B, Hq, D]``: de-RoPE'd with ``query_rotation
    [B, 2, D]`` (:func:`runtime_kernels.rope.derope_coefficients`) in float32, rounded to the classifier
    weights' dtype, as the Triton classifier computes it while loading ``q``."""
    return derope_at(q, query_rotation).to(params.w1.dtype)


def classifier_rows(q: torch.Tensor, classifiers: int) -> torch.Tensor:
    """``q [B, Hq, D]`` as each classifier's batch: ``[B·G, Hc, D]``, row ``b·G + g`` holding query head
    ``c·G + g`` of row ``b`` for classifier ``c`` (``G = Hq / Hc``; the identity's layout for ``G = 1``)."""
    b, hq, d = q.shape
    g = hq // classifiers
    return q.view(b, classifiers, g, d).transpose(1, 2).reshape(b * g, classifiers, d)


def query_head_logits(logits: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of :func:`classifier_rows` on the classifiers' output: ``[B·G, Hc, C]`` -> ``[B, Hq, C]``."""
    rows, hc, c = logits.shape
    g = rows // batch
    return logits.reshape(batch, g, hc, c).transpose(1, 2).reshape(batch, hc * g, c)


def classify_queries(q_derope: torch.Tensor, params: SaapLayerParams) -> torch.Tensor:
    """Bucket probabilities per query head: ``q_derope [B, Hq, D]`` -> ``[B, Hq, C]`` (softmax, float32).

    Every classifier's 2-layer MLP at once (batch-norm in eval mode, i.e. with running statistics); a
    classifier shared by a KV head's query heads takes their queries as rows of one batch."""
    b = q_derope.shape[0]
    x = classifier_rows(q_derope.float(), params.num_classifiers).transpose(0, 1)  # [Hc, B·G, D]
    h = torch.baddbmm(params.b1.float().unsqueeze(1), x, params.w1.float())  # [Hc, B·G, Hd]
    inv = torch.rsqrt(params.bn_var.float() + params.bn_eps)
    h = (h - params.bn_mean.float().unsqueeze(1)) * (inv * params.bn_weight.float()).unsqueeze(1)
    h = torch.relu(h + params.bn_bias.float().unsqueeze(1))
    logits = torch.baddbmm(params.b2.float().unsqueeze(1), h, params.w2.float())  # [Hc, B·G, C]
    return torch.softmax(query_head_logits(logits.transpose(0, 1), b), -1)


def rank_buckets(probs: torch.Tensor, group: int, top_l: int) -> torch.Tensor:
    """Top-ℓ buckets per KV head: ``probs [B, Hq, C]`` -> ``[B, Hkv, min(ℓ, C)]`` int64, best first.

    Query heads ``h*group .. h*group + group - 1`` share KV head ``h`` (the transformers GQA layout);
    their probabilities are summed (paper §5, "batched queries").
    """
    b, hq, c = probs.shape
    score = probs.view(b, hq // group, group, c).sum(2)  # [B, Hkv, C]
    return score.topk(min(top_l, c), dim=-1).indices


# --------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One partial softmax (App. F Alg. 1, over a whole key set at once), float32.

    ``q [..., G, D]``, ``k, v [..., M, D]``, ``valid [..., M]`` -> ``o [..., G, D]`` (unnormalized,
    ``Σ exp(s - m) v``), ``m [..., G]`` (max score, ``-inf`` if no valid key), ``s [..., G]`` (``Σ exp(s - m)``).
    """
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # [..., G, M]
    scores = scores.masked_fill(~valid.unsqueeze(-2), float("-inf"))
    m = scores.amax(-1) if scores.shape[-1] else scores.new_full(scores.shape[:-1], float("-inf"))
    p = torch.exp(scores - torch.where(torch.isinf(m), 0.0, m).unsqueeze(-1))  # exp(-inf) = 0 for masked keys
    return p @ v.float(), m, p.sum(-1)


def merge_partials(o: torch.Tensor, m: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact log-sum-exp merge of ``P`` partials: ``o [..., P, D]``, ``m, s [..., P]`` ->
    (attention output ``[..., D]``, log-sum-exp ``[..., ]``). Empty partials (``m = -inf``) weigh 0.
    """
    m_max = m.amax(-1, keepdim=True)  # [..., 1]
    m_max = torch.where(torch.isinf(m_max), 0.0, m_max)
    w = torch.exp(m - m_max)  # [..., P], 0 for empty partials
    num = (w.unsqueeze(-1) * o).sum(-2)
    den = (w * s).sum(-1)
    return num / den.unsqueeze(-1), m_max.squeeze(-1) + torch.log(den)


def dense_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
                           ) -> torch.Tensor:
    """Plain attention of one query per head over the whole cache (GQA): ``q [B, Hq, D]`` -> ``[B, Hq, D]``."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    qg = q.view(b, hkv, hq // hkv, d)
    valid = torch.ones(k_cache.shape[:-1], dtype=torch.bool, device=q.device)
    o, m, s = partial_attention(qg, k_cache, v_cache, valid, scale)
    return (o / s.unsqueeze(-1)).reshape(b, hq, d).to(q.dtype)


def saap_decode_attention_reference(q: torch.Tensor, q_derope: torch.Tensor, k_cache: torch.Tensor,
                                    v_cache: torch.Tensor, index: BucketIndex | None, params: SaapLayerParams,
                                    top_l: int, scale: float | None = None, cache_len: torch.Tensor | None = None
                                    ) -> torch.Tensor:
    """SAAP attention for one decode step.

    ``q [B, Hq, D]`` RoPE'd query (for the attention), ``q_derope [B, Hq, D]`` (for the classifier),
    ``k_cache, v_cache [B, Hkv, T, D]`` (RoPE'd keys, current token last), ``index`` built for these
    ``T`` keys -> ``[B, Hq, D]`` in ``q.dtype``. ``params.dense`` (layer 0) means plain attention.
    ``cache_len [B]``: row ``b`` holds only its first ``cache_len[b]`` keys (a ragged batch; the index
    covers the shortest row's).
    """
    b, hq, d = q.shape
    hkv, t = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if params.dense:
        if cache_len is not None and int(cache_len.min()) != t:
            raise ValueError("the dense reference takes one cache length for the whole batch")
        return dense_decode_attention(q, k_cache, v_cache, scale)
    check_index_fits(index, t if cache_len is None else int(cache_len.min()), params)
    g = hq // hkv
    lo, hi = dense_region(index, params)
    if top_l <= 0 or lo == hi:  # nothing outside the dense region to rank
        buckets = torch.zeros(b, hkv, 0, dtype=torch.long, device=q.device)
    else:
        buckets = rank_buckets(classify_queries(q_derope, params), g, top_l)
    return sparse_attention_reference(q, k_cache, v_cache, index, params, buckets, scale, cache_len)


def sparse_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: BucketIndex,
                               params: SaapLayerParams, buckets: torch.Tensor, scale: float,
                               cache_len: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the dense region plus every key of ``buckets [B, Hkv, L]``, merged
    exactly: the attention half of :func:`saap_decode_attention_reference`, for a bucket choice made
    elsewhere (e.g. a diagnostic oracle). ``q [B, Hq, D]`` -> ``[B, Hq, D]`` in ``q.dtype``;
    ``cache_len [B]``: the dense region of row ``b`` ends at ``cache_len[b]`` (default: ``T``)."""
    b, hq, d = q.shape
    hkv, t = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    qg = q.view(b, hkv, g, d)
    lo, hi = dense_region(index, params)
    # partial 0: the dense region (sink + recent window)
    dense_pos = torch.cat([torch.arange(lo, device=q.device), torch.arange(hi, t, device=q.device)])
    if cache_len is None:
        valid = torch.ones(b, hkv, dense_pos.numel(), dtype=torch.bool, device=q.device)
    else:
        valid = (dense_pos[None, :] < cache_len.to(q.device)[:, None])[:, None].expand(b, hkv, -1)
    o0, m0, s0 = partial_attention(qg, k_cache[:, :, dense_pos], v_cache[:, :, dense_pos], valid, scale)
    if hi == lo or buckets.shape[-1] == 0:
        return (o0 / s0.unsqueeze(-1)).reshape(b, hq, d).to(q.dtype)
    # partials 1..L: every key of each visited bucket
    pos, valid = index.gather_buckets(buckets)  # [B, Hkv, L, M]
    nl, mm = pos.shape[-2], pos.shape[-1]
    flat = pos.flatten(2).unsqueeze(-1).expand(-1, -1, -1, d)  # [B, Hkv, L*M, D]
    kb = k_cache.gather(2, flat).view(b, hkv, nl, mm, d)
    vb = v_cache.gather(2, flat).view(b, hkv, nl, mm, d)
    ob, mb, sb = partial_attention(qg.unsqueeze(2).expand(-1, -1, nl, -1, -1), kb, vb, valid, scale)  # [B,Hkv,L,G,.]
    o = torch.cat([o0.unsqueeze(2), ob], 2).transpose(2, 3)  # [B, Hkv, G, 1+L, D]
    m = torch.cat([m0.unsqueeze(2), mb], 2).transpose(2, 3)  # [B, Hkv, G, 1+L]
    s = torch.cat([s0.unsqueeze(2), sb], 2).transpose(2, 3)
    out, _ = merge_partials(o, m, s)
    return out.reshape(b, hq, d).to(q.dtype)
