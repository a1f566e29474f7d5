"""SAAP classifier training data from one prompt (Mazaré et al., arXiv:2502.08246, §4 Eq. 1, App. A).

For query ``i`` of head ``h`` the target is row ``i`` of ``A·H_k``: ``A`` the real attention of the
RoPE'd query over the prompt's RoPE'd keys (``q·k/√d``, softmax) with the sink excluded and the row
renormalized (i.e. a softmax over the non-sink keys), not causally masked by default (the paper;
``causal=True`` keeps keys ``j ≤ i``), and ``H_k`` the one-hot bucket of each key, so
``target[h, i, c]`` is the attention mass of bucket ``c`` and each row sums to 1.

Only long-range queries are kept: the query's top-1 key (sink excluded) lies more than ``long_range``
tokens before it. The top-1 is taken over the keys the query sees at decode (``j ≤ i``, ``causal=True``
by default): a decode query never sees the future, so "its best key is far back" is about its past.
With a teacher-forced gold answer, :func:`prompt_training_rows` also adds the answer's decode positions.

Everything runs on one prompt's tensors, chunked over queries (memory ``O(chunk · T)`` per head), so
the recipe calls it inside the collection pass and keeps only the sampled queries and their targets.
GQA layout: query head ``h`` reads KV head ``h // (Hq // Hkv)``. Design notes: docs/notes/saap-recipe.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_BUDGET = 1 << 24  # elements of one [Hq, chunk, T] score buffer


def _chunk(chunk: int | None, hq: int, t: int) -> int:
    return chunk if chunk is not None else max(1, _BUDGET // max(1, hq * t))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    """``q [Hq, n, D]``, ``k [Hkv, T, D]`` -> ``[Hq, n, T]`` float32 scores times ``scale`` (GQA).

    ``scale=None`` leaves them unscaled (an argmax does not need the extra pass over the buffer)."""
    hq, n, d = q.shape
    hkv = k.shape[0]
    s = q.float().reshape(hkv, (hq // hkv) * n, d) @ k.float().transpose(1, 2)  # [Hkv, G*n, T]
    return s.view(hq, n, -1) if scale is None else s.view(hq, n, -1) * scale


def top1_key_distance(q_rope: torch.Tensor, k_rope: torch.Tensor, *, positions: torch.Tensor | None = None,
                      sink: int = 1, causal: bool = True, scale: float | None = None,
                      chunk: int | None = None) -> torch.Tensor:
    """``i - argmax_j q_i·k_j`` over non-sink keys (``j ≤ i`` if causal): ``[Hq, P]`` int64.

    ``q_rope [Hq, T, D]``, ``k_rope [Hkv, T, D]``; ``positions [P]`` the queries to test (default all
    ``T``). Queries with no eligible key (``i < sink`` when causal) get ``-1``. Negative values
    (non-causal) mean the top key is in the future. ``scale`` (the softmax scale, positive) does not
    move an argmax, so the raw products are compared; it is accepted for the callers' symmetry.
    """
    hq, t, d = q_rope.shape
    kpos = torch.arange(t, device=q_rope.device)
    positions = kpos if positions is None else positions.to(q_rope.device)
    chunk = _chunk(chunk, hq, t)
    out = torch.empty(hq, positions.numel(), dtype=torch.int64, device=q_rope.device)
    for start in range(0, positions.numel(), chunk):
        qpos = positions[start:start + chunk]
        width = int(qpos.max()) + 1 if causal else t  # a causal query sees no key beyond the chunk's last one
        s = _scores(q_rope[:, qpos], k_rope[:, :width], None)  # [Hq, n, width]; a positive scale keeps the argmax
        bad = (kpos[:width] < sink).expand(qpos.numel(), -1)
        if causal:
            bad = bad | (kpos[None, :width] > qpos[:, None])
        s = s.masked_fill(bad, float("-inf"))
        dist = qpos[None, :] - s.argmax(-1)
        out[:, start:start + chunk] = torch.where(bad.all(-1)[None, :], -1, dist)
    return out


def long_range_query_mask(q_rope: torch.Tensor, k_rope: torch.Tensor, long_range: int, *, sink: int = 1,
                          causal: bool = True, scale: float | None = None, chunk: int | None = None) -> torch.Tensor:
    """``[Hq, T]`` bool: the query's top-1 key (sink excluded) is more than ``long_range`` tokens back."""
    return top1_key_distance(q_rope, k_rope, sink=sink, causal=causal, scale=scale, chunk=chunk) > long_range


def sample_queries(distance: torch.Tensor, long_range: int, n: int, *, min_pos: int = 1,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``n`` query columns per head, long-range ones first: ``distance [Hq, P]`` -> ``[Hq, n]``.

    Per head: a uniform random subset of the long-range queries (``distance > long_range``); if a head
    has fewer than ``n``, all of them plus the remaining queries with the largest top-1 distance
    (columns ``≥ min_pos``), so every head gets ``n`` rows and batched training stays rectangular.
    Returns ``(columns [Hq, n] int64, is_long_range [Hq, n] bool)``; the second says how many were
    truly long-range (log it).
    """
    hq, t = distance.shape
    if n > t - min_pos:
        raise ValueError(f"cannot sample {n} queries from {t} candidates (min position {min_pos})")
    noise = torch.rand(hq, t, generator=generator).to(distance.device)
    is_lr = distance > long_range
    # sort key: long-range queries first in random order, then the rest by decreasing distance
    key = torch.where(is_lr, 2.0 + noise, torch.sigmoid(distance.float() / max(1, long_range)) + 1e-3 * noise)
    key[:, :min_pos] = -1.0
    pos = key.topk(n, dim=-1).indices
    return pos, is_lr.gather(1, pos)


def select_training_queries(q_rope: torch.Tensor, k_rope: torch.Tensor, n: int, long_range: int, *,
                            sink: int = 1, causal: bool = True, candidates: int | None = None,
                            scale: float | None = None, generator: torch.Generator | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` training query positions per head of one prompt: ``([Hq, n] int64, is_long_range [Hq, n])``.

    The top-1 test costs ``O(T)`` per query, so only ``candidates`` random positions (those that can be
    long-range, beyond ``long_range``, first) are tested (default: every position ``≥ max(sink, 1)``);
    :func:`sample_queries` then picks among them.
    """
    t = q_rope.shape[1]
    pool = torch.arange(max(sink, 1), t)
    if candidates is not None and candidates < pool.numel():
        key = torch.rand(pool.numel(), generator=generator) + (pool > long_range).float()
        pool = pool[key.topk(candidates).indices].sort().values
    dist = top1_key_distance(q_rope, k_rope, positions=pool, sink=sink, causal=causal, scale=scale)
    cols, is_lr = sample_queries(dist, long_range, n, min_pos=0, generator=generator)
    return pool.to(cols.device)[cols], is_lr


def kl_targets(q_rope: torch.Tensor, k_rope: torch.Tensor, key_bucket: torch.Tensor, query_idx: torch.Tensor,
               C: int, *, causal: bool = False, sink: int = 1, scale: float | None = None,
               chunk: int | None = None) -> torch.Tensor:
    """Rows of ``A·H_k`` for the chosen queries: ``[Hq, nq, C]`` float32, each row summing to 1.

    Args:
        q_rope: ``[Hq, T, D]`` RoPE'd queries of one prompt; k_rope: ``[Hkv, T, D]`` RoPE'd keys.
        key_bucket: ``[Hkv, T]`` bucket of each key (its de-RoPE'd key's nearest centroid); sink
            positions are ignored whatever they hold.
        query_idx: ``[nq]`` positions shared by all heads, or ``[Hq, nq]`` per head.
        C: number of buckets. causal: keep only keys ``j ≤ i``. sink: leading keys excluded.
    """
    hq, t, d = q_rope.shape
    hkv = k_rope.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if query_idx.dim() == 1:
        query_idx = query_idx.expand(hq, -1)
    nq = query_idx.shape[1]
    if causal and bool((query_idx < sink).any()):
        raise ValueError(f"causal targets need query positions >= sink={sink} (a query must see a key)")
    if t <= sink:
        raise ValueError(f"a prompt of {t} tokens has no key outside the sink ({sink})")
    kpos = torch.arange(t, device=q_rope.device)
    bucket = key_bucket.long().clamp(min=0).repeat_interleave(hq // hkv, 0)  # [Hq, T]
    chunk = _chunk(chunk, hq, t)
    out = torch.empty(hq, nq, C, dtype=torch.float32, device=q_rope.device)
    for start in range(0, nq, chunk):
        qi = query_idx[:, start:start + chunk]  # [Hq, n]
        q = q_rope.gather(1, qi.unsqueeze(-1).expand(-1, -1, d))  # [Hq, n, D]
        width = int(qi.max()) + 1 if causal else t  # keys past the chunk's last query carry no causal mass
        s = _scores(q, k_rope[:, :width], scale)  # [Hq, n, width]
        bad = (kpos[:width] < sink).expand_as(s)
        if causal:
            bad = bad | (kpos[None, None, :width] > qi[..., None])
        p = torch.softmax(s.masked_fill(bad, float("-inf")), -1)  # sink excluded, renormalized
        tgt = torch.zeros(hq, qi.shape[1], C, dtype=torch.float32, device=q_rope.device)
        out[:, start:start + chunk] = tgt.scatter_add_(-1, bucket[:, None, :width].expand_as(p), p)
    return out


def answer_query_positions(prompt_len: int, answer_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Decode-time query positions of a teacher-forced answer: ``[prompt_len, prompt_len + answer_len)``.

    The runtime prefills the prompt densely; the logits of the last prompt position (``prompt_len - 1``,
    a prefill query) give answer token 0. Each later step feeds the token just emitted, so answer token
    ``j`` sits at position ``prompt_len + j`` and its query (sparse decode attention) predicts token
    ``j + 1``; the last answer token's query predicts the stop token. These ``answer_len`` positions are
    all the decode queries that produce the gold answer and its end.
    """
    return torch.arange(prompt_len, prompt_len + answer_len, device=device)


@dataclass
class PromptRows:
    """One prompt's classifier rows: per head ``n`` sampled rows, then the ``m`` answer rows."""

    positions: torch.Tensor  # [Hq, n + m] int64
    long_range: torch.Tensor  # [Hq, n + m] bool: top-1 key (causal, sink excluded) > long_range back
    answer: torch.Tensor  # [Hq, n + m] bool: the row is a teacher-forced answer position
    targets: torch.Tensor  # [Hq, n + m, C] rows of A·H_k


def prompt_training_rows(q_rope: torch.Tensor, k_rope: torch.Tensor, key_bucket: torch.Tensor, n: int,
                         long_range: int, C: int, *, prompt_len: int | None = None, sink: int = 1,
                         causal_targets: bool = False, candidates: int | None = None,
                         scale: float | None = None, generator: torch.Generator | None = None) -> PromptRows:
    """Training queries and targets of one (possibly teacher-forced) sequence.

    Answer-aware rows (``method.classifier.teacher_forced_answer``): the sequence may be the prompt
    followed by its gold answer's tokens. The sampled queries and their targets then come from the prompt
    part only, exactly as without the answer, and the answer positions are added for every head: the
    queries the decode runtime sees while it emits the answer. Their targets are causal (a decode query
    sees only its past), whatever ``causal_targets`` says for the prompt's rows.

    ``q_rope [Hq, T, D]``, ``k_rope [Hkv, T, D]``, ``key_bucket [Hkv, T]`` cover the whole sequence;
    ``prompt_len`` (default ``T``) is where the prompt ends and the appended answer begins.

    * ``n`` sampled rows per head: :func:`select_training_queries` (the long-range test over each query's
      past keys, as at decode) and :func:`kl_targets` on the prompt part ``[:prompt_len]`` only, so
      positions (same ``generator`` state) and targets are those of the prompt alone.
    * ``m = T - prompt_len`` answer rows, the same positions for every head
      (:func:`answer_query_positions`), added on top of the ``n`` (not counted in them): causal
      targets over all ``T`` keys, the attention the decode step computes.
    """
    hq, t, _ = q_rope.shape
    prompt_len = t if prompt_len is None else int(prompt_len)
    if not 0 < prompt_len <= t:
        raise ValueError(f"prompt_len={prompt_len} outside (0, {t}]")
    qp, kp = q_rope[:, :prompt_len], k_rope[:, :prompt_len]
    pos, is_lr = select_training_queries(qp, kp, n, long_range, sink=sink, causal=True,
                                         candidates=candidates, scale=scale, generator=generator)
    pos = pos.to(q_rope.device)
    tgt = kl_targets(qp, kp, key_bucket[:, :prompt_len], pos, C, causal=causal_targets, sink=sink, scale=scale)
    is_answer = torch.zeros_like(is_lr)
    if prompt_len < t:
        apos = answer_query_positions(prompt_len, t - prompt_len, q_rope.device)
        a_lr = top1_key_distance(q_rope, k_rope, positions=apos, sink=sink, causal=True, scale=scale) > long_range
        a_tgt = kl_targets(q_rope, k_rope, key_bucket, apos, C, causal=True, sink=sink, scale=scale)
        pos = torch.cat([pos, apos.expand(hq, -1)], 1)
        is_lr = torch.cat([is_lr, a_lr.to(is_lr.device)], 1)
        is_answer = torch.cat([is_answer, torch.ones_like(a_lr, device=is_answer.device)], 1)
        tgt = torch.cat([tgt, a_tgt], 1)
    return PromptRows(pos, is_lr, is_answer, tgt)
