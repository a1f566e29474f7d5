"""SAAP decode attention, plain PyTorch: the definition of correct (Mazaré et al., arXiv:2502.08246, §4-§5, App. F).

One decode step of one layer. The cache holds ``T`` keys (the current token's key is the last one);
the single query of each head sits at position ``T - 1``. Keys split into:

* the **dense region**: the first ``sink`` positions plus the ``recent`` most recent ones
  (``[0, sink) ∪ [T - recent, T)``; "1+2047" for Llama-3.1, so the config value ``window = sink + recent``);
* the **bucket candidates**: every other key, positions ``[sink, T - recent)``, listed by bucket in a
  :class:`runtime_kernels.saap.bucket_index.BucketIndex` (disjoint from the dense region).

Each key is assigned at arrival to its nearest (L2) k-means centroid of its KV head, computed on the
de-RoPE'd key. An MLP classifier (one shared by the KV head's group, or the query head's own) maps the
de-RoPE'd query to a distribution over the ``C`` buckets; the ``G`` query heads of a GQA group sum their
probabilities and the group visits the ``ℓ`` highest buckets (all ``ℓ``: the paper's Alg. 2 guard
``ℓ > b_i > 0`` skips the last one, we do not). Attention is computed exactly (RoPE'd ``q·k``) over the
dense region (one partial) and over *all* keys of each visited bucket (one partial per bucket), and the
``ℓ + 1`` partials are merged by log-sum-exp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from runtime_kernels.rope import derope_at
from runtime_kernels.saap.bucket_index import BucketIndex, searchable_range

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
