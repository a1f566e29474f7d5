"""Mean next-token NLL of a model on long natural text, dense and with an artifact applied.

A measure that does not depend on task accuracy: the text (by default ``artifacts/texts/persuasion.txt``,
a public-domain novel, see ``artifacts/texts/README.md``) is tokenized once and cut into consecutive
chunks of ``chunk_tokens`` tokens. Each chunk is scored the way a model reads and writes:

- the first ``chunk_tokens - decode_tokens`` tokens in one prefill call (prefill methods act here:
  SALE, SampleAttention); every next-token prediction inside the prefill is scored;
- the last ``decode_tokens`` tokens one at a time with the KV cache (teacher forcing; decode methods act
  here: SAAP, SANTA), each step predicting the following token.

The NLL is in nats per token; ``nll_prefill`` and ``nll_decode`` average the two parts separately and
``nll`` all scored tokens. A chunk of T tokens scores T - 1 predictions. Chunks (all of one token count) are
scored several at a time, as rows of one batch without padding, so a method sees each as it would alone.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm.auto import tqdm

from calib import dense_cache
from calib.errors import UserError
from calib.paths import project_root
from runtime_kernels import hf

# runtime_kernels.generate is imported where used: it imports transformers, whose import is heavy, and the
# CLI imports this module (through calib.evaluate and the recipes) for checks that must fail fast.

LOGIT_SLICE = 1024  # positions whose logits are materialized at once (vocab x this x 4 bytes)
DEFAULT_BATCH_TOKENS = 65536  # chunk tokens scored together (8 chunks of 8192)


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
                      targets: torch.Tensor) -> torch.Tensor:
    """Summed NLL (a 0-d float64 tensor, left on the device: no host sync) of ``targets: [N]`` under the
    output layer ``head = (weight [V, H], bias)`` applied to ``hidden: [N, H]``, in the head's dtype (at
    least float32 whatever the model's), ``LOGIT_SLICE`` positions at a time."""
    weight, bias = head
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for start in range(0, hidden.shape[0], LOGIT_SLICE):
        logits = torch.nn.functional.linear(hidden[start:start + LOGIT_SLICE].to(weight.dtype), weight, bias)  # [n, V]
        total += torch.nn.functional.cross_entropy(logits, targets[start:start + LOGIT_SLICE], reduction="sum")
    return total


def _output_head(model: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output layer's ``(weight [V, H], bias)`` in float32, or float64 for a float64 model."""
    out_layer = model.get_output_embeddings()
    dtype = torch.promote_types(out_layer.weight.dtype, torch.float32)
    bias = getattr(out_layer, "bias", None)
    return out_layer.weight.to(dtype), None if bias is None else bias.to(dtype)


@torch.inference_mode()
def batch_nll(model: Any, rows: Sequence[Sequence[int]], decode_tokens: int,
              on_step: Callable[[], None] | None = None) -> NllResult:
    """Score chunks of one token count together: prefill all but the last ``decode_tokens`` tokens of every
    row in one call (``[R, n_prefill]``), then teacher-forced decode steps of all rows (``[R, 1]`` each).

    No padding and no attention mask, so any attention the model runs (a method's runtime included) sees
    each row as it would alone. ``on_step`` is called after each model call (a progress bar's tick).
    """
    from runtime_kernels.generate import cache_argument, output_cache

    if len({len(ids) for ids in rows}) != 1:
        raise ValueError(f"chunks of different lengths {sorted({len(ids) for ids in rows})} cannot be batched")
    device = next(model.parameters()).device
    tokens = torch.tensor([list(ids) for ids in rows], device=device)  # [R, T]
    n_rows, n_tokens = tokens.shape
    n_prefill = n_tokens - decode_tokens
    if n_prefill < 2:
        raise UserError(f"chunk of {n_tokens} tokens with decode_tokens={decode_tokens}: nothing left to prefill")
    decoder, head = model.get_decoder(), _output_head(model)
    out = decoder(input_ids=tokens[:, :n_prefill], use_cache=True)
    hidden = out.last_hidden_state  # [R, n_prefill, H]
    nll_prefill = sum(_nll_of_positions(head, hidden[r, :-1], tokens[r, 1:n_prefill]) for r in range(n_rows))
    past, states = output_cache(out), [hidden[:, -1].clone()]  # states[i]: [R, H], predicts tokens[:, n_prefill + i]
    del out, hidden
    arg = cache_argument(decoder)
    if on_step is not None:
        on_step()
    for pos in range(n_prefill, n_tokens - 1):
        step = decoder(input_ids=tokens[:, pos:pos + 1], use_cache=True, **{arg: past})
        past = output_cache(step)
        states.append(step.last_hidden_state[:, -1])
        if on_step is not None:
            on_step()
    result = NllResult(chunks=n_rows, tokens_prefill=n_rows * (n_prefill - 1), nll_sum_prefill=float(nll_prefill))
    if decode_tokens > 0:
        decoded = torch.stack(states, dim=1)  # [R, decode_tokens, H]
        targets = tokens[:, n_prefill:]  # [R, decode_tokens]
        flat = decoded.reshape(-1, decoded.shape[-1])  # [R * decode_tokens, H], row-major like targets
        result.nll_sum_decode = float(_nll_of_positions(head, flat, targets.reshape(-1)))
        result.tokens_decode = n_rows * decode_tokens
    return result


def chunk_nll(model: Any, ids: Sequence[int], decode_tokens: int) -> NllResult:
    """Score one chunk: :func:`batch_nll` of a batch of one."""
    return batch_nll(model, [ids], decode_tokens)


def mean_nll(model: Any, chunks: Sequence[Sequence[int]], decode_tokens: int, runtime: Any = None,
             batch_tokens: int = DEFAULT_BATCH_TOKENS) -> NllResult:
    """Summed NLL over ``chunks``, scored by :func:`batch_nll` up to ``batch_tokens`` tokens per batch (at least
    one chunk; ``<= 0``: one chunk at a time, :func:`calib.generation.equal_length_batches`); ``runtime``'s
    stats are drained per batch. The progress bar counts model calls (a prefill or a decode step)."""
    from calib.generation import equal_length_batches

    batches = equal_length_batches([len(ids) for ids in chunks], batch_tokens)
    calls = len(batches) * max(1, decode_tokens)
    total = NllResult()
    with tqdm(total=calls, desc="real-text NLL", unit="step", leave=False, disable=calls < 64 or None) as bar:
        for idx in batches:
            total.add(batch_nll(model, [chunks[i] for i in idx], decode_tokens, on_step=lambda: bar.update(1)))
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


def cached_dense_nll(loaded: Any, chunks: Sequence[Sequence[int]], decode_tokens: int,
                     batch_tokens: int = DEFAULT_BATCH_TOKENS) -> NllResult:
    """The dense :func:`mean_nll` of ``chunks``, read from ``artifacts/cache/eval_dense_nll/<key>.json`` when the
    same model scored the same chunks with the same settings before (:func:`calib.dense_cache.cache_key`)."""
    key = dense_cache.cache_key(loaded, [int(decode_tokens), int(batch_tokens)], (list(ids) for ids in chunks))
    cached = dense_cache.read("eval_dense_nll", key)
    if cached is not None:
        print(f"dense real-text NLL: reused cache/eval_dense_nll/{key}.json", file=sys.stderr)
        return NllResult(**cached)
    result = mean_nll(loaded.model, chunks, decode_tokens, batch_tokens=batch_tokens)
    dense_cache.write("eval_dense_nll", key, asdict(result))
    return result


def real_text_nll(loaded: Any, *, chunk_tokens: int, chunks: int, decode_tokens: int, artifact: Any = None,
                  options: dict[str, dict[str, Any]] | None = None, text_path: Path | None = None,
                  batch_tokens: int = DEFAULT_BATCH_TOKENS) -> dict[str, float]:
    """Dense NLL of ``loaded`` on the real text and, with ``artifact``, the NLL with it applied
    (``runtime_kernels.hf.apply(model, artifact, options=options)``); see :func:`nll_report`. Chunks are
    scored ``batch_tokens`` tokens at a time (:func:`mean_nll`)."""
    path = text_path or real_text_path()
    if not path.is_file():
        raise UserError(f"real text {path} is missing: see artifacts/texts/README.md")
    limit = int(loaded.model.config.max_position_embeddings)
    if chunk_tokens > limit:
        raise UserError(f"eval.nll.chunk_tokens={chunk_tokens} exceeds the model's context ({limit})")
    pieces = text_chunks(loaded.tokenizer, path.read_text(encoding="utf-8"), chunk_tokens, chunks)
    dense = cached_dense_nll(loaded, pieces, decode_tokens, batch_tokens)
    sparse = None
    if artifact is not None:
        runtime = hf.apply(loaded.model, artifact, options=options, serve="method")
        try:
            sparse = mean_nll(loaded.model, pieces, decode_tokens, runtime, batch_tokens)
        finally:
            hf.remove(loaded.model)
    return nll_report(dense, sparse)
