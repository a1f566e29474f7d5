#!/usr/bin/env python
"""Stage 0 of the tiny model's training: multi-query associative recall on batches built on the device.

Trained only on the synthetic tasks, the tiny Llama never formed the circuit key-conditioned copying needs
(a head that moves a key's identity onto its value's position, and one that matches the asked key against
it); isolated here, the lookup sits on a long loss plateau that the ``adjacent`` form breaks first. So
``train_tiny.py`` runs recall stages (``TrainConfig.recall``) before its task phases. Findings:
docs/results/tiny-model.md, "How the tiny model learned key-value lookup".

Data: a context of ``n`` pairs (keys: distinct name tokens of the tiny vocabulary; values: names, or
numbers as the tokenizer writes them, a leading digit then ``##d`` pieces), then ``queries`` recall lines
whose keys are drawn with replacement from the context, each value token a supervised target (no other
loss), a pure function of a seeded device generator. Formats (``layout`` + optional value digits, ``json7``):
``adjacent`` ``k v`` (offset 1), ``colon`` ``k: v,`` (offset 2), ``json`` ``"k": "v",`` as kv_retrieval writes
it (offset 4), ``repeat`` (the control: ``adjacent``'s context copied in order, solvable without matching keys).

As a script, the ablation harness: every variant trains a fresh model of the tiny shape and prints held-out
teacher-forced accuracy by number of pairs (chance = 1/n)::

    python scripts/recall_stage.py --variants base,adjacent --steps 1500
    python scripts/recall_stage.py --variants "A=formats:adjacent;B=formats:json,init:A" --save /tmp/r
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from calib.data.tokenizer import tiny_vocabulary  # noqa: E402
from calib.data.vocab import name_pool  # noqa: E402

LAYOUTS = {  # one pair line; "K" and "V" are the key and the value tokens
    "adjacent": ("K", "V"),
    "repeat": ("K", "V"),
    "colon": ("K", ":", "V", ","),
    "json": ('"', "K", '"', ":", '"', "V", '"', ","),
}
FORMAT = re.compile(r"(adjacent|repeat|colon|json)(\d*)")


@dataclass(frozen=True)
class RecallStage:
    """One recall stage: its data, its own AdamW and cosine schedule (floor 0.1 of ``lr``)."""

    formats: tuple[str, ...] = ("adjacent",)  # step s uses formats[s % len(formats)]
    steps: int = 7000
    batch: int = 256
    queries: int = 32
    min_pairs: int = 1
    max_pairs: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup: int = 100
    names: int = 3000  # keys (and name values) come from the first `names` names of the vocabulary
    # Stop early once held-out accuracy reaches ``until`` in every format at ``until_pairs`` pairs (0 =
    # max_pairs), checked every ``check_every`` steps; the learning rate then stays at ``lr`` after warm-up
    # instead of following the cosine, because the plateau breaks at a step no schedule can know (a cosine
    # decayed by then may leave it half broken). ``steps`` is then the most it may take.
    until: float = 0.0
    until_pairs: int = 0
    check_every: int = 250

    def __post_init__(self) -> None:
        for f in self.formats:
            parse_format(f)
        if not 1 <= self.min_pairs <= self.max_pairs:
            raise ValueError(f"recall stage: need 1 <= min_pairs <= max_pairs, got {self.min_pairs}, {self.max_pairs}")
        if not 0.0 <= self.until <= 1.0 or self.until_pairs < 0 or self.check_every < 1:
            raise ValueError(f"recall stage: need 0 <= until <= 1, until_pairs >= 0, check_every >= 1; got "
                             f"{self.until}, {self.until_pairs}, {self.check_every}")

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then constant (``until`` set) or cosine to 0.1 of ``lr`` over ``steps``."""
        warm = min(1.0, (step + 1) / self.warmup)
        if self.until > 0:
            return self.lr * warm
        return self.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / self.steps)))

    @classmethod
    def parse(cls, spec: str) -> "RecallStage":
        """``field:value,...`` over this class's fields; ``formats`` joins several with ``+``."""
        return replace(cls(), **_parse_fields(cls, spec))


def parse_format(fmt: str) -> tuple[str, int]:
    """``json7`` -> ("json", 7); ``json`` -> ("json", 0) (a name value: one token)."""
    m = FORMAT.fullmatch(fmt)
    if not m:
        raise ValueError(f"recall format {fmt!r}: expected one of {sorted(LAYOUTS)}, optionally followed by a "
                         f"number of digits (json7)")
    return m.group(1), int(m.group(2) or 0)


def _parse_fields(cls, spec: str) -> dict:
    known = {f.name: f for f in fields(cls)}
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, val = item.partition(":")
        if not sep or key not in known:
            raise ValueError(f"{cls.__name__} {spec!r}: expected field:value items; fields: {list(known)}")
        default = getattr(cls(), key)
        if isinstance(default, tuple):
            out[key] = tuple(val.split("+"))
        elif isinstance(default, bool):
            out[key] = val.lower() in ("1", "true", "yes")
        else:
            out[key] = type(default)(val)
    return out


@dataclass(frozen=True)
class RecallTokens:
    """Ids of the tiny tokenizer's tokens that recall lines are made of."""

    punct: dict[str, int]
    names: torch.Tensor   # [3000] name-token ids
    lead: torch.Tensor    # ids of "1".."9" (a number's first digit)
    cont: torch.Tensor    # ids of "##0".."##9" (its following digits)

    @classmethod
    def tiny(cls) -> "RecallTokens":
        vocab = {t: i for i, t in enumerate(tiny_vocabulary())}
        return cls(punct={p: vocab[p] for p in ('"', ":", ",", "{", "}", "<s>")},
                   names=torch.tensor([vocab[n] for n in name_pool()]),
                   lead=torch.tensor([vocab[str(d)] for d in range(1, 10)]),
                   cont=torch.tensor([vocab[f"##{d}"] for d in range(10)]))


def make_batch(fmt: str, n: int, batch: int, queries: int, tokens: RecallTokens, gen: torch.Generator,
               device, names: int = 3000) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` [batch, T] and a bool mask of the positions whose NEXT token is a supervised value token.

    ``<s> {`` + n context lines + ``}`` + ``queries`` recall lines (``repeat``: the n context lines again).
    """
    layout, digits = parse_format(fmt)
    line = LAYOUTS[layout]
    pool = tokens.names[:names].to(device)
    if pool.numel() < 2 * n:
        raise ValueError(f"recall batch: {n} pairs need {2 * n} distinct names, the pool has {pool.numel()}")
    order = torch.rand(batch, pool.numel(), generator=gen, device=device).argsort(1)[:, : 2 * n]
    keys = pool[order[:, :n]].unsqueeze(-1)                                   # [B, n, 1]
    if digits:
        lead = tokens.lead.to(device)[torch.randint(0, 9, (batch, n, 1), generator=gen, device=device)]
        rest = tokens.cont.to(device)[torch.randint(0, 10, (batch, n, digits - 1), generator=gen, device=device)]
        values = torch.cat([lead, rest], -1)                                  # [B, n, digits]
    else:
        values = pool[order[:, n:]].unsqueeze(-1)                             # [B, n, 1]
    if layout == "repeat":
        queries = n
        asked = torch.arange(n, device=device).expand(batch, n)
    else:
        asked = torch.randint(0, n, (batch, queries), generator=gen, device=device)

    def lines(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cols = [k if t == "K" else v if t == "V" else torch.full_like(k, tokens.punct[t]) for t in line]
        return torch.cat(cols, -1).flatten(1)

    qk = keys.gather(1, asked.unsqueeze(-1))
    qv = values.gather(1, asked.unsqueeze(-1).expand(-1, -1, values.shape[-1]))
    head = torch.tensor([tokens.punct["<s>"], tokens.punct["{"]], device=device).expand(batch, 2)
    close = torch.full((batch, 1), tokens.punct["}"], device=device)
    ids = torch.cat([head, lines(keys, values), close, lines(qk, qv)], 1)
    width = len(line) - 1 + values.shape[-1]
    v_off = line.index("V")
    starts = 2 + n * width + 1 + torch.arange(queries, device=device) * width   # first token of each recall line
    value_at = (starts[:, None] + v_off + torch.arange(values.shape[-1], device=device)).flatten()
    if layout == "repeat":  # the copied keys too, all but the first
        value_at = torch.cat([value_at, starts[1:] + line.index("K")])
    target = torch.zeros_like(ids, dtype=torch.bool)
    target[:, value_at - 1] = True  # the position before a value token predicts it
    return ids, target


def loss_acc(model, ids: torch.Tensor, target: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy and accuracy of the next token at the ``target`` positions only."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = model.model(input_ids=ids).last_hidden_state
        logits = model.lm_head(hidden[target]).float()
    nxt = ids[:, 1:][target[:, :-1]]
    return torch.nn.functional.cross_entropy(logits, nxt), (logits.argmax(-1) == nxt).float().mean()


def train_stage(model, stage: RecallStage, tokens: RecallTokens, device, seed: int, log, log_every: int = 250,
                name: str = "recall") -> list[dict]:
    """Train ``model`` in place on one stage; returns its log records (loss and accuracy of the step; with
    ``stage.until``, also each held-out check and a last record saying whether and when it was reached)."""
    decay = [w for w in model.parameters() if w.dim() >= 2]
    rest = [w for w in model.parameters() if w.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": stage.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=stage.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    autocast = device.type == "cuda"
    model.train()
    records, t0 = [], time.time()
    check_pairs = stage.until_pairs or stage.max_pairs
    for step in range(stage.steps):
        lr = stage.lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        fmt = stage.formats[step % len(stage.formats)]
        n = int(torch.randint(stage.min_pairs, stage.max_pairs + 1, (1,), generator=gen, device=device))
        ids, target = make_batch(fmt, n, stage.batch, stage.queries, tokens, gen, device, stage.names)
        loss, acc = loss_acc(model, ids, target, autocast)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % log_every == 0 or step + 1 == stage.steps:
            rec = {"step": step + 1, "phase": name, "format": fmt, "pairs": n, "lr": round(lr, 7),
                   "loss": round(loss.item(), 4), "acc": round(acc.item(), 4),
                   "elapsed_s": round(time.time() - t0, 1)}
            records.append(rec)
            log(json.dumps(rec))
        if stage.until > 0 and ((step + 1) % stage.check_every == 0 or step + 1 == stage.steps):
            acc_by = evaluate_stage(model, stage.formats, [check_pairs], tokens, device, seed, batch=64,
                                    queries=stage.queries, names=stage.names)
            worst = min(by_n[check_pairs] for by_n in acc_by.values())
            reached = worst >= stage.until
            rec = {"step": step + 1, "phase": name, "check_pairs": check_pairs, "check_acc": worst,
                   "until": stage.until, "reached": reached, "elapsed_s": round(time.time() - t0, 1)}
            records.append(rec)
            log(json.dumps(rec) + ("" if reached or step + 1 < stage.steps else
                                   f"  WARNING: {name} never reached {stage.until} at {check_pairs} pairs "
                                   f"in {stage.steps} steps"))
            if reached:
                break
    return records


@torch.no_grad()
def evaluate_stage(model, formats, pairs, tokens: RecallTokens, device, seed: int, batch: int = 64,
                   queries: int = 32, names: int = 3000) -> dict[str, dict[int, float]]:
    """Teacher-forced value-token accuracy per format and number of pairs, on batches of a held-out seed."""
    was_training = model.training
    model.eval()
    gen = torch.Generator(device=device).manual_seed(10_000 + seed)
    out = {}
    for fmt in formats:
        out[fmt] = {n: round(float(loss_acc(model, *make_batch(fmt, n, batch, queries, tokens, gen, device, names),
                                            device.type == "cuda")[1]), 4) for n in pairs}
    model.train(was_training)
    return out


# --------------------------------------------------------------------------------------------------
# The ablation harness


@dataclass(frozen=True)
class Variant:
    """A fresh model (the tiny shape unless changed here) trained on one recall stage."""

    tied: bool = True
    layers: int = 4
    hidden: int = 256
    rope_theta: float = 10000.0
    init: str = ""  # start from the weights an earlier variant of the same run saved (needs --save)


def _first_table(fmt: str, **changes) -> RecallStage:
    """A stage with the first ablation's settings (1500 steps of 64 sequences, 4-32 pairs, lr 5e-4)."""
    return RecallStage(**{"steps": 1500, "batch": 64, "lr": 5e-4, "min_pairs": 4, "max_pairs": 32,
                          "formats": (fmt,), **changes})


PRESETS: dict[str, tuple[Variant, RecallStage]] = {  # the ablation of docs/results/tiny-model.md
    "base": (Variant(), _first_table("json")),
    "adjacent": (Variant(), _first_table("adjacent")),
    "colon": (Variant(), _first_table("colon")),
    "lr2e-3": (Variant(), _first_table("json", lr=2e-3)),
    "untied": (Variant(tied=False), _first_table("json")),
    "wd0": (Variant(), _first_table("json", weight_decay=0.0)),
    "names256": (Variant(), _first_table("json", names=256)),
    "hidden512": (Variant(hidden=512), _first_table("json")),
    "layers2": (Variant(layers=2), _first_table("json")),
    "theta5e5": (Variant(rope_theta=5e5), _first_table("json")),
    "repeat": (Variant(), _first_table("repeat")),
}


def parse_variant(spec: str) -> tuple[str, Variant, RecallStage]:
    """A preset name, or ``name=field:value,...`` over the fields of Variant and RecallStage."""
    if spec in PRESETS:
        return (spec, *PRESETS[spec])
    name, sep, rest = spec.partition("=")
    if not sep:
        raise ValueError(f"variant {spec!r}: not a preset ({', '.join(PRESETS)}) nor name=field:value,...")
    model_keys = {f.name for f in fields(Variant)}
    items = [i for i in rest.split(",") if i.strip()]
    mine = ",".join(i for i in items if i.split(":")[0].strip() in model_keys)
    theirs = ",".join(i for i in items if i.split(":")[0].strip() not in model_keys)
    return name, replace(Variant(), **_parse_fields(Variant, mine)), RecallStage.parse(theirs)


def build_model(v: Variant, vocab_size: int, seed: int, device):
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=v.hidden, intermediate_size=3 * v.hidden,
                      num_hidden_layers=v.layers, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=4096, tie_word_embeddings=v.tied, initializer_range=0.02,
                      rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": v.rope_theta})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(device)
    model.config._attn_implementation = "sdpa"
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="recall-stage ablation: " + __doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(PRESETS),
                    help="comma-separated presets, or 'name=field:value,...' items separated by ';'")
    ap.add_argument("--steps", type=int, default=None, help="override every variant's steps")
    ap.add_argument("--batch", type=int, default=None, help="override every variant's batch")
    ap.add_argument("--eval-pairs", default="4,8,16,32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--log-every", type=int, default=250)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--save", type=Path, default=None,
                    help="save each variant's weights (bf16) under DIR/<variant>; train_tiny.py --init-from reads them")
    args = ap.parse_args(argv)
    pairs = [int(x) for x in args.eval_pairs.split(",")]
    specs = args.variants.split(";") if "=" in args.variants else args.variants.split(",")
    try:
        variants = [parse_variant(s.strip()) for s in specs if s.strip()]
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokens = RecallTokens.tiny()
    results = []
    for name, v, stage in variants:
        stage = replace(stage, **{k: getattr(args, k) for k in ("steps", "batch") if getattr(args, k)})
        print(f"== {name}: {v} {stage}", flush=True)
        model = build_model(v, len(tiny_vocabulary()), args.seed, device)
        if v.init:
            if args.save is None:
                raise SystemExit(f"error: variant {name!r} starts from {v.init!r}: pass --save (where it was saved)")
            missing, unexpected = model.load_state_dict(load_file(str(args.save / v.init / "model.safetensors")),
                                                        strict=False)
            assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        t0 = time.time()
        curve = train_stage(model, stage, tokens, device, args.seed, lambda m: print(f"  {name} {m}", flush=True),
                            args.log_every, name)
        acc = evaluate_stage(model, stage.formats, pairs, tokens, device, args.seed, names=stage.names)
        if args.save:
            model.to(torch.bfloat16).save_pretrained(args.save / name)
            model.float()
        results.append({"variant": name, "model": asdict(v), "stage": asdict(stage), "acc": acc, "curve": curve,
                        "seconds": round(time.time() - t0, 1)})
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
    print(f"\n{'variant':<12} {'format':<9} " + " ".join(f"{'n=' + str(n):>6}" for n in pairs) + "  seconds")
    for r in results:
        for fmt, by_n in r["acc"].items():
            print(f"{r['variant']:<12} {fmt:<9} " + " ".join(f"{by_n[n]:>6.3f}" for n in pairs)
                  + f"  {r['seconds']:>7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
