"""SAAP's bucket index: each KV head's bucket candidates in per-bucket inverted lists
(Mazaré et al., arXiv:2502.08246, §4-§5, App. F).

A key is assigned at arrival to its nearest (L2) k-means centroid, computed on the de-RoPE'd key
(:func:`nearest_centroid`). The index lists only bucket candidates, positions ``[sink, T - recent)``
(:func:`searchable_range`): the dense sink and window are attended apart, so the two never overlap and a
kernel needs no window test. A key that leaves the recent window is inserted in its bucket then (its
bucket id was recorded when it arrived). :mod:`runtime_kernels.saap.reference` defines the attention
that reads it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

_ASSIGN_BUDGET = 1 << 24  # elements of one [..., chunk, C] distance buffer in the nearest-centroid search
_ASSIGN_BUDGET_CUDA = 1 << 26  # ... on a GPU: fewer, larger launches (an index build is launch-bound)


def searchable_range(seq_len: int, sink: int, recent: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` that are bucket candidates in a cache of ``seq_len`` keys (may be empty)."""
    lo = min(sink, seq_len)
    return lo, max(lo, seq_len - recent)


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
