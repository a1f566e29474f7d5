#!/usr/bin/env python
"""Why does SAAP lose niah_single prompts at 8192 tokens on ``tiny``? Diagnostics and ablations.

Everything runs through the real decode path (``calib.evaluate.greedy_generate`` with the model's
KV cache, ``runtime_kernels.hf.attach``), with :class:`DiagDecode`, a :class:`SaapDecode` whose
decode step can

* apply SAAP on a subset of layers only (the others return ``None`` = the model's dense attention);
* rank buckets by the classifier (the runtime's ``rank_buckets(classify_queries(...))``), by an
  **oracle** (the group's true attention mass per bucket at this step: Σ over the group's query heads
  of softmax(q·K/√d) summed over each bucket's keys), or visit **all** buckets (a sanity check: must
  equal dense);
* override ℓ and the dense window (``recent``; the index is built with it at prefill);
* record, per decode step and SAAP layer and query head, the attention recall of the visited set
  (true softmax mass over all keys that falls inside window + visited buckets) for the classifier and
  the oracle ranking, the needle's share of the attention and how much of it is visited.

Attention in a SAAP step is :func:`saap_attention_with_buckets`, the reference's code with the bucket
choice passed in; with classifier buckets it is checked against
``runtime_kernels.saap.reference.saap_decode_attention_reference`` on every step (``--check``).

Stages (``--stage``; each prints a table and writes ``<out>/<stage>.json``):

* ``find``   : dense vs SAAP answers for ``--num-prompts`` eval prompts (eval.seed), the failing set.
* ``ablate`` : on the failing prompts (read from ``find.json``) every variant of ``VARIANTS``.
* ``recall`` : recall / needle statistics per layer and head, on the dense trajectory (SAAP observes
  but does not change the output) and on the SAAP trajectory, per answer step.
* ``all``    : every variant on the whole prompt set (accuracy of oracle vs classifier etc.).

Usage (CPU, 1 thread)::

    A=<artifact dir or models:/saap-tiny/N>       # session 7: saap-tiny v11 (C=256, l=16, 45 prompts)
    python scripts/diag_saap_niah.py --artifact $A --stage find   --num-prompts 40
    python scripts/diag_saap_niah.py --artifact $A --stage ablate
    python scripts/diag_saap_niah.py --artifact $A --stage recall
    python scripts/diag_saap_niah.py --artifact $A --stage all --variants saap16,oracle16 --num-prompts 40

Size-aware rankings (``rank="density"`` / ``"hybrid"``, :func:`size_aware_choice`; density = p_c / n_c^γ with
p_c the group's summed classifier probability and n_c the bucket's listed keys): ``dens_b16`` visits buckets
in density order until the key count of plain top-16 is reached, ``dens16`` is top-16 by density,
``dens05_*`` γ = 0.5, ``hyb16_e8`` plain top-16 plus the 8 densest others, ``hyb8_b16`` plain top-8 then
density order up to the key budget of plain top-16; ``dens_g0_b16`` must equal ``saap16``. The ``all`` and
``ablate`` tables also give ``fixed`` (of the prompts ``find.json`` lists as failing)::

    python scripts/diag_saap_niah.py --artifact $A --stage all --num-prompts 80 --tag density80 \
        --variants saap16,dens_b16,dens_b32,dens05_b16,dens05_b32,dens8,dens16,dens32,dens05_16,dens05_32,hyb16_e8,hyb16_e16,hyb8_e8,hyb12_e4
    python scripts/diag_saap_niah.py --artifact $A --stage all --num-prompts 80 --tag density80b \
        --variants dens_b12,dens_b24,hyb8_b16,hyb4_b16,hyb12_e8,hyb8_e4

Recall vs selectivity of the same rankings on the calibration eval's held-out set:
``scripts/diag_saap_density.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from runtime_kernels.saap.api import SaapDecode  # noqa: E402
from runtime_kernels.saap.reference import (  # noqa: E402
    BucketIndex,
    SaapLayerParams,
    classify_queries,
    rank_buckets,
    saap_decode_attention_reference,
    searchable_range,
    sparse_attention_reference,
)



# --------------------------------------------------------------------------------------------------
# SAAP attention with an externally chosen bucket set (the reference, bucket choice factored out)
# --------------------------------------------------------------------------------------------------


def saap_attention_with_buckets(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: BucketIndex,
                                params: SaapLayerParams, buckets: torch.Tensor, scale: float) -> torch.Tensor:
    """``saap_decode_attention_reference`` with ``buckets [B, Hkv, L]`` given: ``q [B, Hq, D]`` -> ``[B, Hq, D]``."""
    return sparse_attention_reference(q, k_cache, v_cache, index, params, buckets, scale)


def true_attention(q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense softmax of every query head over all ``T`` keys: ``q [B, Hq, D]`` -> ``[B, Hq, T]`` float32."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    s = (q.float().view(b, hkv, hq // hkv, d) @ k_cache.float().transpose(-1, -2)) * scale  # [B, Hkv, G, T]
    return torch.softmax(s, -1).reshape(b, hq, -1)


def masked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Exact attention over the keys of ``mask [B, Hkv, T]`` (any visited set): ``q [B, Hq, D]`` -> ``[B, Hq, D]``."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    s = (q.float().view(b, hkv, hq // hkv, d) @ k_cache.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask.unsqueeze(2), float("-inf"))
    return (torch.softmax(s, -1) @ v_cache.float()).reshape(b, hq, d).to(q.dtype)


def bucket_mass(p: torch.Tensor, index: BucketIndex, params: SaapLayerParams, group: int) -> torch.Tensor:
    """Per query head the true mass of each bucket's *listed* keys: ``p [B, Hq, T]`` -> ``[B, Hq, C]``."""
    b, hq, t = p.shape
    lo, hi = index.sink, index.searchable_hi
    kb = index.key_bucket[..., lo:hi].long().repeat_interleave(group, 1)  # [B, Hq, N]
    out = torch.zeros(b, hq, index.num_clusters, dtype=p.dtype, device=p.device)
    return out.scatter_add_(-1, kb, p[..., lo:hi])


def visited_mask(index: BucketIndex, buckets: torch.Tensor, t: int) -> torch.Tensor:
    """``[B, Hkv, T]`` bool: window (sink + recent) plus every listed key of ``buckets [B, Hkv, L]``."""
    b, hkv, _ = buckets.shape
    lo, hi = index.sink, index.searchable_hi
    mask = torch.ones(b, hkv, t, dtype=torch.bool, device=buckets.device)
    kb = index.key_bucket[..., lo:hi].long()  # [B, Hkv, N]
    chosen = torch.zeros(b, hkv, index.num_clusters, dtype=torch.bool, device=buckets.device)
    chosen.scatter_(-1, buckets, True)
    mask[..., lo:hi] = chosen.gather(-1, kb)
    return mask


def size_aware_choice(probs: torch.Tensor, cnt: torch.Tensor, group: int, top_l: int, *, gamma: float = 1.0,
                      budget_l: int | None = None, hybrid_e: int = 0, mode: str = "density") -> torch.Tensor:
    """Bucket set ``[B, Hkv, C]`` bool of a size-aware ranking.

    ``probs [B, Hq, C]`` classifier probabilities, ``cnt [B, Hkv, C]`` keys per bucket. ``p = Σ_group probs``,
    ``density = p / max(n, 1)^gamma`` (empty buckets last). ``mode="density"``: the top-``top_l`` buckets by
    density, or with ``budget_l`` the density-ordered prefix whose keys reach the key count of plain
    top-``budget_l`` (the bucket that crosses the budget is included). ``mode="hybrid"``: plain top-``top_l``
    by ``p`` plus the top-``hybrid_e`` by density among the others, or with ``budget_l`` plain top-``top_l`` then the density order among the
    others until the key count of plain top-``budget_l`` is reached.
    """
    b, hq, c = probs.shape
    p = probs.view(b, hq // group, group, c).sum(2)  # [B, Hkv, C]
    n = cnt.to(p.dtype)
    dens = (p / n.clamp(min=1) ** gamma).masked_fill(cnt <= 0, float("-inf"))
    chosen = torch.zeros_like(cnt, dtype=torch.bool)
    if mode == "hybrid":
        chosen.scatter_(-1, p.topk(min(top_l, c), -1).indices, True)
        if budget_l is None:
            rest = dens.masked_fill(chosen, float("-inf")).topk(min(hybrid_e, c), -1).indices
            return chosen.scatter_(-1, rest, True) & ((cnt > 0) | chosen)
        dens = dens.masked_fill(chosen, float("-inf"))  # fill the rest of the key budget by density
    if budget_l is None:
        return chosen.scatter_(-1, dens.topk(min(top_l, c), -1).indices, True)
    plain = torch.zeros_like(chosen).scatter_(-1, p.topk(min(budget_l, c), -1).indices, True)
    budget = (cnt.long() * plain).sum(-1, keepdim=True) - (cnt.long() * chosen).sum(-1, keepdim=True)
    order = torch.sort(dens, dim=-1, descending=True, stable=True).indices
    n_sorted = cnt.long().gather(-1, order)
    before = n_sorted.cumsum(-1) - n_sorted
    take = (before < budget) & (n_sorted > 0) & (dens.gather(-1, order) > float("-inf"))
    return chosen | torch.zeros_like(chosen).scatter_(-1, order, take)


# --------------------------------------------------------------------------------------------------
# The diagnostic decode runtime
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Variant:
    name: str
    layers: tuple[int, ...] | None = None  # SAAP layers (None = every non-dense layer)
    rank: str = "classifier"  # classifier | oracle | all | none (window only)
    top_l: int | None = None  # None = the artifact's ℓ
    recent: int | None = None  # None = the artifact's window - sink
    first_steps: int | None = None  # SAAP only on the first n decode steps (then dense)
    skip_steps: int = 0  # dense on the first n decode steps (then SAAP)
    dense: bool = False  # no runtime at all (the model's SDPA)
    tiny: int = 0  # also visit every bucket holding at most this many keys
    artifact: str | None = None  # another artifact (a recalibration)
    # size-aware rankings (rank="density" | "hybrid"); p_c = the group's summed classifier probability,
    # n_c = keys currently listed in bucket c; density = p_c / n_c^gamma
    gamma: float = 1.0
    budget_l: int | None = None  # density: visit in density order until the keys of plain top-budget_l are reached
    hybrid_e: int = 0  # hybrid: plain top-ℓ by p_c plus the top-E buckets by density among the rest


class DiagDecode(SaapDecode):
    """SaapDecode with the switches of :class:`Variant` and per-step records (``self.records``)."""

    def __init__(self, layers: list[SaapLayerParams], top_l: int, variant: Variant, *, observe: bool = False,
                 check: bool = False, record: bool = True) -> None:
        super().__init__(layers, top_l, impl="reference", stats=False)
        self.variant = variant
        self.observe = observe  # record, but return None (dense) in every layer
        self.check = check
        self.record = record
        self.records: list[dict[str, Any]] = []
        self.selectivity: list[float] = []  # visited bucket keys / all bucket keys, per active (step, layer)
        self.step = -1
        self.needle: list[int] = []  # positions of the needle's value tokens
        self.needle_sentence: tuple[int, int] = (0, 0)

    def observe_prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx) -> None:
        """Also keep the de-RoPE'd prompt keys (``self.prefill_keys``) so variants can rebuild the index."""
        if getattr(self, "prefill_keys", None) is not None and k.shape[2] == q.shape[2]:
            self.prefill_keys[layer] = self._derope(k, ctx, 0)
        super().observe_prefill(layer, q, k, v, ctx)

    def build_index(self, prefill_keys: dict[int, torch.Tensor]) -> None:
        """The per-layer :class:`BucketIndex` from stored de-RoPE'd prompt keys (what prefill would build)."""
        self.index.clear()
        for layer, kd in prefill_keys.items():
            p = self.layers[layer]
            if not p.dense:
                self.index[layer] = BucketIndex.build(kd, self._params(layer, kd.device).centroids, sink=p.sink,
                                                      recent=p.recent)

    def reset(self, needle: list[int], sentence: tuple[int, int]) -> None:
        self.records, self.step, self.needle, self.needle_sentence = [], -1, list(needle), sentence
        self.selectivity = []
        self.index.clear()

    def _active(self, layer: int) -> bool:
        v = self.variant
        if self.observe or self.layers[layer].dense:
            return False
        if v.layers is not None and layer not in v.layers:
            return False
        if v.first_steps is not None and self.step >= v.first_steps:
            return False
        return self.step >= v.skip_steps

    def select(self, rank: str, q: torch.Tensor, q_de: torch.Tensor, p: torch.Tensor, idx: BucketIndex,
               params: SaapLayerParams, top_l: int) -> torch.Tensor:
        g = q.shape[1] // params.num_kv_heads
        c = params.num_clusters
        if rank == "classifier":
            return rank_buckets(classify_queries(q_de, params), g, top_l)
        if rank == "oracle":
            score = bucket_mass(p, idx, params, g)  # [B, Hq, C]
            return rank_buckets(score, g, top_l)
        if rank in ("ip", "cls+ip"):
            # IVF-style probe: per query head a softmax over the buckets of q_de·centroid (same scale as the
            # attention), summed over the group; "cls+ip" visits the classifier's top ℓ/2 and fills up to ℓ
            # with the best inner-product buckets not already chosen
            hkv = params.num_kv_heads
            s = (q_de.float().view(q.shape[0], hkv, g, -1) @ params.centroids.float().transpose(-1, -2).unsqueeze(0))
            ip = torch.softmax(s * (q.shape[-1] ** -0.5), -1).reshape(q.shape[0], -1, c)  # [B, Hq, C]
            if rank == "ip":
                return rank_buckets(ip, g, top_l)
            half = max(1, top_l // 2)
            first = rank_buckets(classify_queries(q_de, params), g, half)
            score = ip.view(q.shape[0], hkv, g, c).sum(2).scatter(-1, first, float("-inf"))
            rest = score.topk(min(top_l - half, c - half), -1).indices
            return torch.cat([first, rest], -1)
        if rank == "all":
            return torch.arange(c, device=q.device).expand(q.shape[0], params.num_kv_heads, -1)
        if rank == "none":
            return torch.zeros(q.shape[0], params.num_kv_heads, 0, dtype=torch.long, device=q.device)
        raise ValueError(rank)

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               ctx) -> torch.Tensor | None:
        if layer == min(i for i, p in enumerate(self.layers)):
            self.step += 1
        step = self.advance(layer, q, k, ctx)
        if step is None:
            return None
        idx, q_de = step
        t = k.shape[2]
        params = self._params(layer, q.device)
        q0 = q[:, :, 0]
        p = true_attention(q0, k, scale)  # [B, Hq, T]
        if self.record:
            self._record_step(layer, q0, q_de, p, idx, params, t)
        if not self._active(layer):
            return None
        rank, tiny = self.variant.rank, self.variant.tiny
        cnt = idx.bucket_count.long()  # [B, Hkv, C]
        if rank in ("density", "hybrid"):
            g = q0.shape[1] // params.num_kv_heads
            chosen = size_aware_choice(classify_queries(q_de, params), cnt, g, self.top_l, gamma=self.variant.gamma,
                                       budget_l=self.variant.budget_l, hybrid_e=self.variant.hybrid_e, mode=rank)
            buckets = self.select("none", q0, q_de, p, idx, params, self.top_l)
        else:
            buckets = self.select(rank, q0, q_de, p, idx, params, self.top_l)
            chosen = torch.zeros_like(cnt, dtype=torch.bool).scatter_(-1, buckets, True)
        if tiny:  # also every bucket holding <= tiny keys (cheap: rare keys such as a needle's digits)
            chosen |= (cnt <= tiny) & (cnt > 0)
        if tiny or rank in ("density", "hybrid"):
            mask = visited_mask(idx, buckets, t)
            lo, hi = idx.sink, idx.searchable_hi
            mask[..., lo:hi] = chosen.gather(-1, idx.key_bucket[..., lo:hi].long())
            out = masked_attention(q0, k, v, mask, scale)
        else:
            out = saap_attention_with_buckets(q0, k, v, idx, params, buckets, scale)
        self.selectivity.append(float((cnt * chosen).sum() / cnt.sum().clamp(min=1)))
        if self.check and rank == "classifier" and not tiny:
            ref = saap_decode_attention_reference(q0, q_de, k, v, idx, params, self.top_l, scale)
            err = float((out - ref).abs().max())
            assert err < 1e-5, f"diag attention differs from the reference by {err}"
        return out.unsqueeze(2)

    def _record_step(self, layer: int, q: torch.Tensor, q_de: torch.Tensor, p: torch.Tensor, idx: BucketIndex,
                     params: SaapLayerParams, t: int) -> None:
        g = q.shape[1] // params.num_kv_heads
        hq = q.shape[1]
        rec: dict[str, Any] = {"step": self.step, "layer": layer, "T": t}
        needle = torch.tensor(self.needle, dtype=torch.long)
        s0, s1 = self.needle_sentence
        kb = idx.key_bucket[0].long()  # [Hkv, T]
        for rank in ("classifier", "oracle"):
            buckets = self.select(rank, q, q_de, p, idx, params, self.top_l)
            vis = visited_mask(idx, buckets, t).repeat_interleave(g, 1)  # [B, Hq, T]
            rec[f"recall_{rank}"] = (p * vis).sum(-1)[0].tolist()
            rec[f"needle_visited_{rank}"] = (p[0][:, needle] * vis[0][:, needle]).sum(-1).tolist()
            nb = kb[:, needle]  # [Hkv, n] buckets of the needle's value tokens
            rec[f"needle_buckets_in_{rank}"] = [
                [int(x) in set(buckets[0, h].tolist()) for x in nb[h]] for h in range(nb.shape[0])]
            rec[f"buckets_{rank}"] = buckets[0].tolist()
        rec["needle_mass"] = p[0][:, needle].sum(-1).tolist()
        rec["sentence_mass"] = p[0][:, s0:s1].sum(-1).tolist()
        lo, hi = searchable_range(t, params.sink, params.recent)
        rec["window_mass"] = (p[0][:, :lo].sum(-1) + p[0][:, hi:].sum(-1)).tolist()
        rec["sink_mass"] = p[0][:, :params.sink].sum(-1).tolist()
        top = p[0].topk(3, -1)
        rec["top_pos"] = top.indices.tolist()
        rec["top_p"] = top.values.tolist()
        rec["needle_bucket"] = kb[:, needle].tolist()
        # classifier rank of the oracle's best bucket per KV head, and the classifier's prob mass
        probs = classify_queries(q_de, params).view(1, params.num_kv_heads, g, -1).sum(2)[0]  # [Hkv, C]
        order = probs.argsort(-1, descending=True)
        rank_of = torch.empty_like(order)
        rank_of.scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
        nb = kb[:, needle]
        rec["needle_bucket_cls_rank"] = rank_of.gather(-1, nb).tolist()
        omass = bucket_mass(p, idx, params, g)[0].view(params.num_kv_heads, g, -1).sum(1)  # [Hkv, C]
        orank = omass.argsort(-1, descending=True)
        rank_o = torch.empty_like(orank)
        rank_o.scatter_(-1, orank, torch.arange(orank.shape[-1]).expand_as(orank))
        rec["needle_bucket_oracle_rank"] = rank_o.gather(-1, nb).tolist()
        cnt = idx.bucket_count[0].long()
        rec["needle_bucket_size"] = cnt.gather(-1, nb).tolist()
        del hq
        self.records.append(rec)


def make_runtime(artifact: Any, model: Any, variant: Variant, **kw) -> DiagDecode:
    base = SaapDecode.from_artifact(artifact, model)
    layers = base.layers
    if variant.recent is not None:
        layers = [dataclasses.replace(p, recent=int(variant.recent)) for p in layers]
    return DiagDecode(layers, int(variant.top_l or base.top_l), variant, **kw)


# --------------------------------------------------------------------------------------------------
# Prompts, needle location, generation
# --------------------------------------------------------------------------------------------------


def needle_positions(tokenizer: Any, prompt: Any) -> tuple[list[int], tuple[int, int]]:
    """Positions of the needle's value tokens (the digits as the prompt spells them) and the token after
    them (``.``), and the span of the needle sentence."""
    from calib.saap.recipe import answer_token_ids

    ids = list(prompt.input_ids)
    val = answer_token_ids(tokenizer, prompt)
    # the question does not contain the value: the first (only) occurrence is the needle
    for cut in (0, 1):  # with or without the leading space token
        sub = val[cut:]
        hits = [i for i in range(len(ids) - len(sub) + 1) if ids[i:i + len(sub)] == sub]
        if hits:
            s = hits[0]
            # sentence: back to the previous "." token, forward to the next one
            dot = set(tokenizer.convert_tokens_to_ids(["."]))
            a = s
            while a > 0 and ids[a - 1] not in dot:
                a -= 1
            e = s + len(sub)
            while e < len(ids) and ids[e] not in dot:
                e += 1
            # value tokens plus the token after them (the last answer step copies the stop from there)
            return list(range(s, s + len(sub) + 1)), (a, e + 1)
    raise RuntimeError(f"needle value {prompt.answer} not found in prompt {prompt.prompt_id}")


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        from calib.config import compose
        from calib.models import load_model
        from runtime_kernels import hf
        from runtime_kernels.artifact import load_artifact

        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.args = args
        cfg = compose(["device=cpu"])
        self.cfg = cfg
        self.loaded = load_model(cfg.model, device="cpu")
        self.hf = hf
        self.facts = hf.model_facts(self.loaded.model)
        self._artifacts: dict[str, Any] = {}
        self.default_artifact = args.artifact
        self.load_artifact = load_artifact
        from calib.evaluate import stop_token_ids

        self.stops = stop_token_ids(self.loaded.tokenizer)
        self.max_new = int(cfg.eval.max_new_tokens)

    def artifact(self, path: str | None) -> Any:
        path = path or self.default_artifact
        if path not in self._artifacts:
            self._artifacts[path] = self.load_artifact(path, model=self.facts)
        return self._artifacts[path]

    def prompts(self, n: int) -> list[Any]:
        from calib.data import build_prompts

        return build_prompts(self.cfg.data, self.loaded.tokenizer, seed=self.args.seed, lengths=[self.args.length],
                             tasks=["niah_single"], num_prompts=n, purpose="evaluation")

    @torch.inference_mode()
    def prefill(self, prompt: Any) -> dict[str, Any]:
        """One dense prefill (shared by every variant): cache, first token, de-RoPE'd prompt keys."""
        model = self.loaded.model
        rt = make_runtime(self.artifact(None), model, VARIANTS["saap16"], record=False)
        rt.prefill_keys = {}
        self.hf.attach(model, decode=rt)
        try:
            out = model(input_ids=torch.tensor([list(prompt.input_ids)]), use_cache=True, logits_to_keep=1)
        finally:
            self.hf.remove(model)
        return {"past": out.past_key_values, "token": out.logits[0, -1].argmax(), "keys": rt.prefill_keys,
                "needle": needle_positions(self.loaded.tokenizer, prompt)}

    @torch.inference_mode()
    def generate_from(self, prompt: Any, pre: dict[str, Any], variant: Variant, *, observe: bool = False,
                      check: bool = False, record: bool = False) -> tuple[str, bool, list[dict[str, Any]]]:
        """``calib.evaluate.greedy_generate``'s decode loop from a copy of the shared prefill."""
        import copy

        from calib.data import exact_match

        model = self.loaded.model
        rt = None
        if not variant.dense or observe:
            rt = make_runtime(self.artifact(variant.artifact), model, variant, observe=observe, check=check,
                              record=record)
            rt.reset(*pre["needle"])
            rt.build_index(pre["keys"])
            self.hf.attach(model, decode=rt)
        past, token, gen = copy.deepcopy(pre["past"]), pre["token"], []
        try:
            for _ in range(self.max_new):
                t = int(token)
                if t in self.stops:
                    break
                gen.append(t)
                out = model(input_ids=token.view(1, 1), past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[0, -1].argmax()
        finally:
            self.hf.remove(model)
        text = self.loaded.tokenizer.decode(gen, skip_special_tokens=True)
        self.last_selectivity = (sum(rt.selectivity) / len(rt.selectivity)) if rt is not None and rt.selectivity else 0.0
        return text, exact_match(text, prompt.answer), (rt.records if rt is not None else [])

    def generate(self, prompt: Any, variant: Variant, *, observe: bool = False, check: bool = False,
                 record: bool = False) -> tuple[str, bool, list[dict[str, Any]]]:
        """The full path (prefill + decode through ``calib.evaluate.greedy_generate``), for cross-checks."""
        from calib.data import exact_match
        from calib.evaluate import greedy_generate

        model = self.loaded.model
        rt = None
        if not variant.dense or observe:
            rt = make_runtime(self.artifact(variant.artifact), model, variant, observe=observe, check=check,
                              record=record)
            rt.reset(*needle_positions(self.loaded.tokenizer, prompt))
            self.hf.attach(model, decode=rt)
        try:
            gen = greedy_generate(model, prompt.input_ids, self.max_new, self.stops)
        finally:
            self.hf.remove(model)
        text = self.loaded.tokenizer.decode(gen, skip_special_tokens=True)
        return text, exact_match(text, prompt.answer), (rt.records if rt is not None else [])


VARIANTS: dict[str, Variant] = {v.name: v for v in [
    Variant("dense", dense=True),
    Variant("saap16"),
    Variant("saap16_L1", layers=(1,)),
    Variant("saap16_L2", layers=(2,)),
    Variant("saap16_L3", layers=(3,)),
    Variant("saap16_L12", layers=(1, 2)),
    Variant("saap16_L23", layers=(2, 3)),
    Variant("saap16_L13", layers=(1, 3)),
    Variant("oracle16", rank="oracle"),
    Variant("oracle16_L1", rank="oracle", layers=(1,)),
    Variant("oracle16_L2", rank="oracle", layers=(2,)),
    Variant("oracle16_L3", rank="oracle", layers=(3,)),
    Variant("oracle4", rank="oracle", top_l=4),
    Variant("oracle8", rank="oracle", top_l=8),
    Variant("saap32", top_l=32),
    Variant("saap64", top_l=64),
    Variant("oracle64", rank="oracle", top_l=64),
    Variant("all", rank="all"),  # every bucket: must equal dense
    Variant("window_only", rank="none"),
    Variant("ip16", rank="ip"),
    Variant("cls+ip16", rank="cls+ip"),
    Variant("cls+ip32", rank="cls+ip", top_l=32),
    Variant("saap16_tiny2", tiny=2),
    Variant("saap16_tiny4", tiny=4),
    Variant("saap16_w128", recent=127),
    Variant("saap16_w256", recent=255),
    Variant("saap16_first1", first_steps=1),  # SAAP only at the first decode step
    Variant("saap16_skip1", skip_steps=1),  # dense at the first decode step, SAAP afterwards
    Variant("saap16_skip2", skip_steps=2),
    # size-aware rankings (density = p_c / n_c^gamma); *_b<L>: key budget of plain top-L
    Variant("dens_g0_b16", rank="density", gamma=0.0, budget_l=16),  # sanity: must equal saap16
    Variant("dens_b16", rank="density", gamma=1.0, budget_l=16),
    Variant("dens_b32", rank="density", gamma=1.0, budget_l=32),
    Variant("dens05_b16", rank="density", gamma=0.5, budget_l=16),
    Variant("dens05_b32", rank="density", gamma=0.5, budget_l=32),
    Variant("dens8", rank="density", gamma=1.0, top_l=8),
    Variant("dens16", rank="density", gamma=1.0, top_l=16),
    Variant("dens32", rank="density", gamma=1.0, top_l=32),
    Variant("dens64", rank="density", gamma=1.0, top_l=64),
    Variant("dens05_16", rank="density", gamma=0.5, top_l=16),
    Variant("dens05_32", rank="density", gamma=0.5, top_l=32),
    Variant("hyb16_e8", rank="hybrid", hybrid_e=8),
    Variant("hyb16_e16", rank="hybrid", hybrid_e=16),
    Variant("hyb8_e8", rank="hybrid", top_l=8, hybrid_e=8),
    Variant("hyb12_e4", rank="hybrid", top_l=12, hybrid_e=4),
    Variant("hyb12_e8", rank="hybrid", top_l=12, hybrid_e=8),
    Variant("hyb8_e4", rank="hybrid", top_l=8, hybrid_e=4),
    Variant("dens_b12", rank="density", gamma=1.0, budget_l=12),
    Variant("dens_b24", rank="density", gamma=1.0, budget_l=24),
    # plain top-ℓ by mass, then density order until the key budget of plain top-16 (matched selectivity)
    Variant("hyb8_b16", rank="hybrid", top_l=8, budget_l=16),
    Variant("hyb4_b16", rank="hybrid", top_l=4, budget_l=16),
]}

ABLATE_DEFAULT = ("saap16,saap16_L1,saap16_L2,saap16_L3,saap16_L12,saap16_L23,saap16_L13,oracle16,oracle16_L1,"
                  "oracle16_L2,oracle16_L3,oracle8,oracle4,saap32,saap64,oracle64,all,window_only,saap16_w128,"
                  "saap16_w256,saap16_first1,saap16_skip1,saap16_skip2")


def parse_variants(spec: str, extra_artifact: str | None) -> list[Variant]:
    out = []
    for name in [s for s in spec.split(",") if s]:
        if name.startswith("new:"):  # the same variant on --new-artifact
            v = dataclasses.replace(VARIANTS[name[4:]], name=name, artifact=extra_artifact)
        else:
            v = VARIANTS[name]
        out.append(v)
    return out


# --------------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------------


def stage_find(h: Harness, out: Path) -> dict[str, Any]:
    prompts = h.prompts(h.args.num_prompts)
    rows = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        pre = h.prefill(p)
        d_text, d_ok, _ = h.generate_from(p, pre, VARIANTS["dense"])
        s_text, s_ok, _ = h.generate_from(p, pre, VARIANTS["saap16"], check=h.args.check)
        if i == 0 and h.args.check:  # the shared-prefill path answers as calib eval's full path does
            full = (h.generate(p, VARIANTS["dense"])[0], h.generate(p, VARIANTS["saap16"])[0])
            assert full == (d_text, s_text), f"shared prefill {(d_text, s_text)} != full path {full}"
        rows.append({"id": p.prompt_id, "answer": p.answer, "dense": d_text, "dense_ok": d_ok, "saap": s_text,
                     "saap_ok": s_ok, "needle_pos": pre["needle"][0][0], "tokens": len(p.input_ids)})
        print(f"{p.prompt_id:>28} gold {p.answer}  dense {d_text!r:>12} {'ok ' if d_ok else 'BAD'}  "
              f"saap16 {s_text!r:>12} {'ok ' if s_ok else 'BAD'}  needle@{rows[-1]['needle_pos']}", flush=True)
    failing = [r["id"] for r in rows if r["dense_ok"] and not r["saap_ok"]]
    res = {"rows": rows, "failing": failing, "dense_acc": sum(r["dense_ok"] for r in rows) / len(rows),
           "saap_acc": sum(r["saap_ok"] for r in rows) / len(rows), "seconds": time.perf_counter() - t0}
    print(f"dense {res['dense_acc']:.3f}  saap16 {res['saap_acc']:.3f}  failing (dense ok, saap wrong): "
          f"{len(failing)}  ({res['seconds']:.0f} s)")
    return res


def _select(h: Harness, out: Path, which: str) -> list[Any]:
    find = json.loads((out / "find.json").read_text())
    ids = find["failing"] if which == "failing" else [r["id"] for r in find["rows"]]
    if h.args.max_failing and which == "failing":
        ids = ids[: h.args.max_failing]
    by_id = {p.prompt_id: p for p in h.prompts(len(find["rows"]))}
    return [by_id[i] for i in ids]


def stage_variants(h: Harness, out: Path, which: str) -> dict[str, Any]:
    prompts = _select(h, out, which)
    variants = parse_variants(h.args.variants or ABLATE_DEFAULT, h.args.new_artifact)
    if not any(v.dense for v in variants):
        variants = [VARIANTS["dense"], *variants]
    answers: dict[str, list[str]] = {v.name: [] for v in variants}
    oks: dict[str, list[bool]] = {v.name: [] for v in variants}
    sels: dict[str, list[float]] = {v.name: [] for v in variants}
    t0 = time.perf_counter()
    for p in prompts:
        pre = h.prefill(p)
        for v in variants:
            text, ok, _ = h.generate_from(p, pre, v, check=h.args.check and v.rank == "classifier")
            answers[v.name].append(text)
            oks[v.name].append(ok)
            sels[v.name].append(h.last_selectivity)
        print(f"  {p.prompt_id} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    table = {v.name: {"acc": sum(oks[v.name]) / len(prompts), "correct": sum(oks[v.name]), "n": len(prompts),
                      "answers": answers[v.name], "ok": oks[v.name],
                      "selectivity": sum(sels[v.name]) / len(prompts)} for v in variants}
    failing = set(json.loads((out / "find.json").read_text())["failing"])
    ids = [p.prompt_id for p in prompts]
    for v in variants:  # of the prompts saap16 loses (find.json), how many this variant answers right
        table[v.name]["fixed"] = sum(ok for i, ok in zip(ids, oks[v.name]) if i in failing)
        table[v.name]["broken"] = sum(not ok for i, ok in zip(ids, oks[v.name]) if i not in failing)
    wide = len(prompts) <= 14
    for v in variants:
        row = " ".join(f"{t if ok else t + '*':>9}" for t, ok in zip(answers[v.name], oks[v.name])) if wide else ""
        print(f"{v.name:>18}: {sum(oks[v.name]):>3}/{len(prompts)}  sel {table[v.name]['selectivity']:.4f}  "
              f"fixed {table[v.name]['fixed']}/{len(failing & set(ids))}  {row}")
    if wide:
        print(f"{'gold':>18}:         " + " ".join(f"{p.answer:>9}" for p in prompts) + "   (* = wrong)")
    return {"prompts": [p.prompt_id for p in prompts], "gold": [p.answer for p in prompts], "table": table,
            "seconds": time.perf_counter() - t0}


def _fmt(x: float) -> str:
    return f"{x:.2f}"


RECALL_KEYS = ("recall_classifier", "recall_oracle", "needle_mass", "needle_visited_classifier",
               "needle_visited_oracle", "window_mass", "sentence_mass", "sink_mass")


def stage_recall(h: Harness, out: Path) -> dict[str, Any]:
    """Per answer step, layer, query head: recall (classifier vs oracle), needle mass, needle visited.

    ``dense`` trajectory: SAAP only observes (every layer dense), so each step is measured on the exact
    dense state; ``saap`` trajectory: the real SAAP run (its state diverges after a wrong token)."""
    prompts = _select(h, out, "failing")
    variant = dataclasses.replace(VARIANTS["saap16"], top_l=h.args.top_l)
    all_recs = {}
    for p in prompts:
        pre = h.prefill(p)
        for traj in ("dense", "saap"):
            text, ok, recs = h.generate_from(p, pre, variant, observe=(traj == "dense"), record=True)
            all_recs[f"{traj}:{p.prompt_id}"] = {"text": text, "ok": ok, "records": recs, "needle": pre["needle"]}
    summary: dict[str, Any] = {}
    for traj in ("dense", "saap"):
        recs = [r for k, v in all_recs.items() if k.startswith(traj + ":") for r in v["records"]]
        for step in range(0, 8):
            for layer in (1, 2, 3):
                rs = [r for r in recs if r["step"] == step and r["layer"] == layer]
                if rs:
                    summary[f"{traj}/step{step}/L{layer}"] = {
                        key: torch.tensor([r[key] for r in rs]).mean(0).tolist() for key in RECALL_KEYS}
    print(f"\nper query head (0-3 share KV head 0, 4-7 KV head 1), mean over {len(prompts)} failing prompts; "
          f"ℓ = {h.args.top_l}")
    for key, agg in summary.items():
        if h.args.verbose or "/step0/" in key or "/step1/" in key:
            print(f"{key:>18} recall cls {' '.join(map(_fmt, agg['recall_classifier']))} | "
                  f"oracle {' '.join(map(_fmt, agg['recall_oracle']))}")
            print(f"{'':>18} needle mass {' '.join(map(_fmt, agg['needle_mass']))} | visited cls "
                  f"{' '.join(map(_fmt, agg['needle_visited_classifier']))} | oracle "
                  f"{' '.join(map(_fmt, agg['needle_visited_oracle']))} | window "
                  f"{' '.join(map(_fmt, agg['window_mass']))}")
    return {"summary": summary, "records": all_recs, "top_l": h.args.top_l}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", choices=["find", "ablate", "recall", "all"], required=True)
    ap.add_argument("--artifact", required=True, help="SAAP artifact: a dir or models:/ URI (session 7: saap-tiny v11)")
    ap.add_argument("--new-artifact", default=None, help="artifact for the variants named new:<variant>")
    ap.add_argument("--seed", type=int, default=616161)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-failing", type=int, default=12)
    ap.add_argument("--variants", default=None)
    ap.add_argument("--top-l", type=int, default=16)
    ap.add_argument("--check", action="store_true", help="compare classifier-mode steps with the reference")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--out", default="outputs/diag_saap_niah")
    ap.add_argument("--tag", default=None, help="suffix of the output json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    h = Harness(args)
    if args.stage == "find":
        res = stage_find(h, out)
    elif args.stage == "ablate":
        res = stage_variants(h, out, "failing")
    elif args.stage == "all":
        res = stage_variants(h, out, "all")
    else:
        res = stage_recall(h, out)
    name = args.stage + (f"_{args.tag}" if args.tag else "")
    (out / f"{name}.json").write_text(json.dumps(res, default=str))
    print(f"wrote {out / (name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
