"""Does SAAP read the needle while it decodes the answer? A per-layer probe of a SAAP artifact.

With every bucket visited SAAP decodes exactly as dense does, so when it loses a needle the question
is whether the buckets a step *chooses* hold the needle. For held-out needle prompts (``eval.cells``),
this script

1. answers each prompt greedily, dense and with the artifact (``calib.evaluate.answer_prompts``), to
   know which answers SAAP flips;
2. teacher-forces the gold answer through eager decode steps with the artifact attached and, at every
   answer step, layer and KV head, records which needle keys (the answer's tokens where they occur in
   the prompt) the step reads (sink, window, or a visited bucket: the same selection the attention
   uses, ``reference.rank_buckets``) and how much of the dense attention of the group's query heads
   falls on them.

It prints, per layer, the dense attention mass on the needle and the share of needle keys read, for the
prompts SAAP answered like dense and for those it lost: a layer whose heads look at the needle (mass) but
whose selection misses it (read share) on the lost prompts is where the ranking limits SAAP.

    python scripts/research/saap_needle_probe.py --artifact <saap artifact dir> --out probe.json \\
        -- model=smollm2 'eval.cells=[niah_single@8192]' eval.num_prompts=200 eval.top_l=32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformers import DynamicCache  # noqa: E402

from calib.config import compose  # noqa: E402
from calib.data import evaluation_prompts  # noqa: E402
from calib.data.prompt import answer_token_ids  # noqa: E402
from calib.evaluate import answer_prompts, runtime_options, with_statistics  # noqa: E402
from calib.models import load_model, resolve_device  # noqa: E402
from runtime_kernels import hf  # noqa: E402
from runtime_kernels.artifact import load_artifact  # noqa: E402
from runtime_kernels.generate import cache_argument  # noqa: E402
from runtime_kernels.saap.reference import classify_queries, dense_region, rank_buckets  # noqa: E402


def needle_positions(input_ids: Sequence[int], answer_ids: Sequence[int]) -> list[int]:
    """Positions of the answer's tokens where they occur in the prompt (the needle): the last occurrence
    of ``answer_ids`` as a contiguous run, else of it without its first token (a leading space that the
    needle sentence tokenizes with the word before); ``[]`` when neither occurs."""
    ids = list(input_ids)
    for run in (list(answer_ids), list(answer_ids)[1:]):
        n = len(run)
        if n == 0:
            continue
        for start in range(len(ids) - n, -1, -1):
            if ids[start:start + n] == run:
                return list(range(start, start + n))
    return []


class NeedleRecorder:
    """Wraps a :class:`runtime_kernels.saap.SaapDecode` (its ``decode`` and ``_record``) to log, per
    decode step and layer, the needle keys read per KV head (all of them in a layer at ℓ >= C, which runs
    dense attention) and the dense attention mass on them."""

    def __init__(self, runtime: Any) -> None:
        self.runtime, self.positions = runtime, torch.empty(0, dtype=torch.long)
        self.rows: list[dict[str, Any]] = []  # one per (step, sparse layer)
        self._decode, self._record = runtime.decode, runtime._record
        runtime.decode, runtime._record = self.decode, self.record

    def close(self) -> None:
        self.runtime.decode, self.runtime._record = self._decode, self._record

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, ctx: Any):
        out = self._decode(layer, q, k, v, scale, ctx)
        if self.positions.numel() and self.runtime.reads_every_key(layer):  # ℓ >= C: dense attention, every key
            self.rows.append({"layer": layer, "read": [1.0] * k.shape[1]})
        if self.positions.numel() and self.rows and self.rows[-1]["layer"] == layer and "mass" not in self.rows[-1]:
            group = q.shape[1] // k.shape[1]
            keys = k.float().repeat_interleave(group, 1)  # [B, Hq, T, D]
            attn = torch.softmax((q.float() @ keys.transpose(-1, -2))[:, :, 0] * scale, -1)  # [B, Hq, T]
            mass = attn[..., self.positions.to(attn.device)].sum(-1)  # [B, Hq]
            self.rows[-1]["mass"] = mass[0].view(k.shape[1], group).sum(-1).div(group).tolist()  # per KV head
        return out

    def record(self, layer: int, q_de: torch.Tensor, idx: Any, t: Any) -> None:
        self._record(layer, q_de, idx, t)
        if not self.positions.numel():
            return
        rt = self.runtime
        params = rt._params(layer, q_de.device)
        group = q_de.shape[1] // idx.bucket_count.shape[1]
        buckets = rank_buckets(classify_queries(q_de, params), group, rt.layer_top_l(layer))[0]  # [Hkv, L]
        pos = self.positions.to(q_de.device)
        lo, hi = dense_region(idx, params)
        key_bucket = idx.key_bucket_buf[0, :, pos].long()  # [Hkv, n]
        visited = (key_bucket[..., None] == buckets[:, None, :]).any(-1)  # [Hkv, n]
        read = visited | (pos < lo)[None] | (pos >= hi)[None]
        self.rows.append({"layer": layer, "read": read.float().mean(-1).tolist()})


def probe_prompt(loaded: Any, recorder: NeedleRecorder, prompt: Any) -> list[dict[str, Any]]:
    """Teacher-force ``prompt``'s gold answer through eager decode steps; the recorder's rows, each with
    its answer step. Batch 1 (SAAP's reference index holds one cache length per batch)."""
    answer = answer_token_ids(loaded.tokenizer, prompt)
    recorder.positions = torch.tensor(needle_positions(prompt.input_ids, answer), dtype=torch.long)
    recorder.rows = []
    if not recorder.positions.numel():
        return []
    device, model = loaded.model.device, loaded.model
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers releases whose DynamicCache takes no config
        cache = DynamicCache()
    kwargs = {cache_argument(model): cache, "use_cache": True, "logits_to_keep": 1}
    steps = []
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt.input_ids], device=device), **kwargs)
        for step, token in enumerate(answer[:-1]):  # the step fed answer token i decodes token i + 1
            before = len(recorder.rows)
            model(input_ids=torch.tensor([[token]], device=device), **kwargs)
            steps += [{**row, "step": step + 1} for row in recorder.rows[before:]]
    return steps


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """``{"held"|"lost": {layer: {"read": mean share of needle keys read, "mass": mean dense mass on the
    needle, "mass_read": the same share with each KV head weighted by its dense mass on the needle (do the
    heads that look at the needle read it?), "steps": rows}}}`` over every (prompt, answer step, KV head)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for rec in records:
        group = out.setdefault("lost" if rec["lost"] else "held", {})
        for row in rec["steps"]:
            cell = group.setdefault(str(row["layer"]), {"read": 0.0, "mass": 0.0, "mass_read": 0.0, "steps": 0,
                                                        "mass_sum": 0.0})
            cell["read"] += sum(row["read"]) / len(row["read"])
            cell["mass"] += sum(row["mass"]) / len(row["mass"])
            cell["mass_read"] += sum(m * r for m, r in zip(row["mass"], row["read"]))
            cell["mass_sum"] += sum(row["mass"])
            cell["steps"] += 1
    for group in out.values():
        for cell in group.values():
            mass_sum = cell.pop("mass_sum")
            cell["mass_read"] = cell["mass_read"] / mass_sum if mass_sum else float("nan")
            cell["read"] /= max(1, cell["steps"])
            cell["mass"] /= max(1, cell["steps"])
    return out


def probe(cfg: Any, artifact_path: str) -> dict[str, Any]:
    """Answer ``cfg``'s held-out prompts dense and with the artifact, then probe every prompt."""
    loaded = load_model(cfg.model, device=str(resolve_device(str(cfg.get("device", "auto")))))
    artifact = load_artifact(artifact_path, model=hf.model_facts(loaded.model))
    if artifact.method != "saap":
        raise SystemExit(f"error: {artifact_path} is a {artifact.method} artifact; the probe reads SAAP's")
    prompts = evaluation_prompts(cfg, loaded.tokenizer)
    new, batch_tokens = int(cfg.eval.max_new_tokens), int(cfg.eval.get("batch_tokens") or 0)
    dense = answer_prompts(loaded, prompts, new, batch_tokens=batch_tokens)
    state = hf.apply(loaded.model, artifact, options=with_statistics(runtime_options(cfg, "saap"), "saap"),
                     serve="method")
    try:
        sparse = answer_prompts(loaded, prompts, new, state, desc="saap", batch_tokens=batch_tokens, loop="eager")
        recorder = NeedleRecorder(state.decode)
        records = []
        for p, d, s in zip(prompts, dense, sparse):
            records.append({"prompt_id": p.prompt_id, "dense": d.correct, "saap": s.correct,
                            "lost": bool(d.correct and not s.correct), "steps": probe_prompt(loaded, recorder, p)})
        recorder.close()
    finally:
        hf.remove(loaded.model)
    return {"prompts": len(prompts), "lost": sum(r["lost"] for r in records),
            "no_needle": sum(not r["steps"] for r in records), "layers": summarize(records), "records": records}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True, help="a SAAP artifact (directory or models:/ URI)")
    ap.add_argument("--out", type=Path, required=True, help="JSON of every prompt's steps and the per-layer summary")
    ap.add_argument("overrides", nargs="*", help="calib config overrides (model=..., eval.cells=..., eval.top_l=...)")
    args = ap.parse_args(argv)
    result = probe(compose(list(args.overrides)), args.artifact)
    args.out.write_text(json.dumps(result))
    print(f"{result['prompts']} prompts, {result['lost']} lost by SAAP, {result['no_needle']} without a needle found")
    print("| layer | needle mass (held) | keys read (held) | mass-weighted read (held) "
          "| needle mass (lost) | keys read (lost) | mass-weighted read (lost) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    held, lost = result["layers"].get("held", {}), result["layers"].get("lost", {})
    for layer in sorted(set(held) | set(lost), key=int):
        h, l = held.get(layer, {}), lost.get(layer, {})
        cells = [f"{c.get(k, float('nan')):.3f}" for c in (h, l) for k in ("mass", "read", "mass_read")]
        print(f"| {layer} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
