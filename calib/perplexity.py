"""Mean next-token NLL of a model on long natural text, dense and with an artifact applied.

A measure that does not depend on task accuracy: the text (by default ``artifacts/texts/persuasion.txt``,
a public-domain novel, see ``artifacts/texts/README.md``) is tokenized once and cut into consecutive
chunks of ``chunk_tokens`` tokens. Each chunk is scored the way a model reads and writes:

- the first ``chunk_tokens - decode_tokens`` tokens in one prefill call (prefill methods act here:
  SALE, SampleAttention); every next-token prediction inside the prefill is scored;
- the last ``decode_tokens`` tokens one at a time with the KV cache (teacher forcing; decode methods act
  here: SAAP, SANTA), each step predicting the following token.

The NLL is in nats per token; ``nll_prefill`` and ``nll_decode`` average the two parts separately and
``nll`` all scored tokens. A chunk of T tokens scores T - 1 predictions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from calib.errors import UserError
from calib.paths import project_root
from runtime_kernels import hf

# runtime_kernels.generate is imported where used: it imports transformers, whose import is heavy, and the
# CLI imports this module (through calib.evaluate and the recipes) for checks that must fail fast.

LOGIT_SLICE = 1024  # positions whose logits are materialized at once (vocab x this x 4 bytes)


def real_text_path() -> Path:
    """The shipped real text (see the module docstring)."""
    return project_root() / "artifacts" / "texts" / "persuasion.txt"


@dataclass
class NllResult:
    """Summed NLL and counts of the scored predictions of some chunks."""

    nll_sum_prefill: float = 0.0
    tokens_prefill: int = 0
    nll_sum_decode: float = 0.0
    tokens_decode: int = 0
    chunks: int = 0

    def add(self, other: "NllResult") -> None:
        for key, value in asdict(other).items():
            setattr(self, key, getattr(self, key) + value)

    def summary(self) -> dict[str, float]:
        """``nll`` (all tokens), ``nll_prefill``, ``nll_decode`` (nats/token, NaN without tokens),
        ``ppl = exp(nll)``, and the token and chunk counts."""
        total = self.tokens_prefill + self.tokens_decode
        nll = (self.nll_sum_prefill + self.nll_sum_decode) / total if total else math.nan
        return {"nll": nll, "ppl": math.exp(nll) if total else math.nan,
                "nll_prefill": self.nll_sum_prefill / self.tokens_prefill if self.tokens_prefill else math.nan,
                "nll_decode": self.nll_sum_decode / self.tokens_decode if self.tokens_decode else math.nan,
                "tokens": float(total), "chunks": float(self.chunks)}


def text_chunks(tokenizer: Any, text: str, chunk_tokens: int, max_chunks: int | None = None) -> list[list[int]]:
    """Consecutive ``chunk_tokens``-token pieces of ``text`` (the remainder is dropped), at most ``max_chunks``.

    Each chunk starts with the tokenizer's BOS when the tokenizer adds one by default (it then holds
    ``chunk_tokens - 1`` text tokens), as the model saw documents in training.
    """
    ids = list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])  # no "longer than max" warning
    bos = getattr(tokenizer, "bos_token_id", None)
    probe = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    lead = [bos] if bos is not None and probe and probe[0] == bos else []
    step = chunk_tokens - len(lead)
    count = len(ids) // step if step > 0 else 0
    if max_chunks is not None:
        count = min(count, max_chunks)
    if count < 1:
        raise UserError(f"the text has {len(ids)} tokens: too short for one chunk of {chunk_tokens}")
    return [lead + ids[i * step:(i + 1) * step] for i in range(count)]


def _nll_of_positions(head: tuple[torch.Tensor, torch.Tensor | None], hidden: torch.Tensor,
                      targets: torch.Tensor) -> float:
    """Summed NLL of ``targets: [N]`` under the output layer ``head = (weight [V, H], bias)`` applied to
    ``hidden: [N, H]``, in float32 whatever the model's dtype, ``LOGIT_SLICE`` positions at a time."""
    weight, bias = head
    total = 0.0
    for start in range(0, hidden.shape[0], LOGIT_SLICE):
        logits = torch.nn.functional.linear(hidden[start:start + LOGIT_SLICE].float(), weight, bias)  # [n, V]
        total += float(torch.nn.functional.cross_entropy(logits, targets[start:start + LOGIT_SLICE], reduction="sum"))
    return total


@torch.inference_mode()
def chunk_nll(model: Any, ids: Sequence[int], decode_tokens: int) -> NllResult:
    """Score one chunk: prefill all but the last ``decode_tokens`` tokens, then teacher-forced decode steps."""
    from runtime_kernels.generate import cache_argument, output_cache

    device = next(model.parameters()).device
    tokens = torch.tensor(list(ids), device=device)  # [T]
    n_prefill = len(ids) - decode_tokens
    if n_prefill < 2:
        raise UserError(f"chunk of {len(ids)} tokens with decode_tokens={decode_tokens}: nothing left to prefill")
    decoder, out_layer = model.get_decoder(), model.get_output_embeddings()
    bias = getattr(out_layer, "bias", None)
    head = (out_layer.weight.float(), None if bias is None else bias.float())
    out = decoder(input_ids=tokens[None, :n_prefill], use_cache=True)
    hidden = out.last_hidden_state[0]  # [n_prefill, H]
    result = NllResult(chunks=1, tokens_prefill=n_prefill - 1)
    result.nll_sum_prefill = _nll_of_positions(head, hidden[:-1], tokens[1:n_prefill])
    past, last = output_cache(out), hidden[-1:]  # last: [1, H], predicts tokens[n_prefill]
    arg = cache_argument(decoder)
    for pos in range(n_prefill, len(ids)):
        result.nll_sum_decode += _nll_of_positions(head, last, tokens[pos:pos + 1])
        result.tokens_decode += 1
        if pos + 1 == len(ids):
            break
        step = decoder(input_ids=tokens[None, pos:pos + 1], use_cache=True, **{arg: past})
        past, last = output_cache(step), step.last_hidden_state[0]
    return result


def mean_nll(model: Any, chunks: Sequence[Sequence[int]], decode_tokens: int, runtime: Any = None) -> NllResult:
    """Summed NLL over ``chunks`` (each scored by :func:`chunk_nll`); ``runtime``'s stats are drained per chunk."""
    total = NllResult()
    for ids in tqdm(list(chunks), desc="real-text NLL", unit="chunk", leave=False, disable=len(chunks) < 2 or None):
        total.add(chunk_nll(model, ids, decode_tokens))
        for rt in (getattr(runtime, "prefill", None), getattr(runtime, "decode", None)):
            if rt is not None and hasattr(rt, "pop_stats"):
                rt.pop_stats()
    return total


def nll_report(dense: NllResult, sparse: NllResult | None) -> dict[str, float]:
    """Flat metrics ``nll_dense``, ``nll_prefill_dense``, ... and, with ``sparse``, the same ``_sparse`` keys
    plus ``nll_increase = nll_sparse / nll_dense - 1`` (relative, so 0.02 is the issue's 2 % bound)."""
    out: dict[str, float] = {}
    for tag, res in (("dense", dense), ("sparse", sparse)):
        if res is None:
            continue
        for key, value in res.summary().items():
            if key in ("tokens", "chunks"):
                out[f"nll_{key}"] = value
            else:
                out[f"{key}_{tag}"] = value
    if sparse is not None:
        out["nll_increase"] = out["nll_sparse"] / out["nll_dense"] - 1.0
        out["nll_increase_prefill"] = out["nll_prefill_sparse"] / out["nll_prefill_dense"] - 1.0
        out["nll_increase_decode"] = out["nll_decode_sparse"] / out["nll_decode_dense"] - 1.0
    return out


def real_text_nll(loaded: Any, *, chunk_tokens: int, chunks: int, decode_tokens: int, artifact: Any = None,
                  options: dict[str, dict[str, Any]] | None = None, text_path: Path | None = None) -> dict[str, float]:
    """Dense NLL of ``loaded`` on the real text and, with ``artifact``, the NLL with it applied
    (``runtime_kernels.hf.apply(model, artifact, options=options)``); see :func:`nll_report`."""
    path = text_path or real_text_path()
    if not path.is_file():
        raise UserError(f"real text {path} is missing: see artifacts/texts/README.md")
    limit = int(loaded.model.config.max_position_embeddings)
    if chunk_tokens > limit:
        raise UserError(f"eval.nll.chunk_tokens={chunk_tokens} exceeds the model's context ({limit})")
    pieces = text_chunks(loaded.tokenizer, path.read_text(encoding="utf-8"), chunk_tokens, chunks)
    dense = mean_nll(loaded.model, pieces, decode_tokens)
    sparse = None
    if artifact is not None:
        runtime = hf.apply(loaded.model, artifact, options=options, serve="method")
        try:
            sparse = mean_nll(loaded.model, pieces, decode_tokens, runtime)
        finally:
            hf.remove(loaded.model)
    return nll_report(dense, sparse)
