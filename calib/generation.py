"""Greedy answer generation: prompts of one token count batched without padding (``calib eval``), or a
left-padded batch of mixed lengths (task suites).

Both stop a sequence at its first stop token (EOS, an end-of-turn marker, and newline unless the answer
is scored by ``contains``), never emit it, and use the KV cache: one prefill call, then one call per new
token. Nothing here imports Hydra, OmegaConf or MLflow, so scripts that run on a bare GPU box can use it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

# runtime_kernels.generate is imported where used: it imports transformers, whose import is heavy, and the
# CLI imports this module (through calib.evaluate and the recipes) for checks that must fail fast.


def stop_token_ids(tokenizer: Any, newline: bool = True) -> set[int]:
    """EOS and end-of-turn markers, plus (``newline``) the newline token: under exact match the answer is
    the reply's first line, so generation can stop there; a ``contains`` score reads the whole reply."""
    ids = {i for i in [tokenizer.eos_token_id] if i is not None}
    for text in (("\n", "Ċ") if newline else ()) + ("<|eot_id|>", "<|im_end|>"):
        tid = tokenizer.convert_tokens_to_ids(text)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None and tid >= 0:
            ids.add(tid)
    return ids


def _check_one_length(batch: Sequence[Sequence[int]]) -> None:
    if len({len(ids) for ids in batch}) > 1:
        raise ValueError(f"prompts of different lengths {sorted({len(ids) for ids in batch})}: "
                         "group them by length (equal_length_batches) or use batched_greedy_generate")


def _rows_before_stop(generated: list[torch.Tensor], batch: int) -> list[list[int]]:
    """Each row's tokens from per-step ``[B]`` tensors holding -1 once that row stopped."""
    if not generated:
        return [[] for _ in range(batch)]
    table = torch.stack(generated, dim=1).tolist()  # [B, steps]
    return [[t for t in row if t >= 0] for row in table]


@torch.inference_mode()
def greedy_generate(model: Any, input_ids: Sequence[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Greedy decoding with a KV cache: one prefill call, then one call per new token."""
    return equal_length_greedy_generate(model, [input_ids], max_new_tokens, stop_ids)[0]


@torch.inference_mode()
def equal_length_greedy_generate(model: Any, batch: Sequence[Sequence[int]], max_new_tokens: int,
                                 stop_ids: set[int]) -> list[list[int]]:
    """:func:`greedy_generate` for prompts of one token count at once: no padding, no attention mask, so
    any attention the model runs (a sparse method's runtime included) sees exactly what it sees for
    one prompt, with a batch dimension. A sequence keeps decoding after its stop token (its later tokens
    are dropped) until every sequence stopped or ``max_new_tokens`` were produced."""
    from runtime_kernels.generate import cache_argument, output_cache

    _check_one_length(batch)
    device, arg = next(model.parameters()).device, cache_argument(model)
    ids = torch.tensor([list(row) for row in batch], device=device)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    past, token = output_cache(out), out.logits[:, -1].argmax(-1)  # token: [B]
    stops = torch.tensor(sorted(stop_ids) or [-1], device=device)
    done = torch.zeros(len(batch), dtype=torch.bool, device=device)
    generated: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        done |= torch.isin(token, stops)
        if bool(done.all()):
            break
        generated.append(torch.where(done, -1, token))
        out = model(input_ids=token[:, None], use_cache=True, **{arg: past})
        past, token = output_cache(out), out.logits[:, -1].argmax(-1)
    return _rows_before_stop(generated, len(batch))


def static_greedy_generate(model: Any, batch: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: set[int],
                           graphs: bool | None = None) -> list[list[int]]:
    """:func:`equal_length_greedy_generate` through the serving loop,
    :class:`runtime_kernels.generate.StaticGenerator`: a preallocated cache and, on CUDA, one CUDA graph
    per decode step (one replay of host time instead of a Python pass over every layer). All
    ``max_new_tokens`` steps run; each row is cut before its first stop token. Prompts may differ in
    length (a ragged batch: rows of close lengths prefilled in one call, padded after their last token, or
    each alone under a prefill method, then decoded together at its own position, unless
    an attached decode runtime keeps state for one length, which the generator refuses)."""
    if max_new_tokens < 1:
        return [[] for _ in batch]
    from runtime_kernels.generate import StaticGenerator

    width = max(len(row) for row in batch)
    gen = StaticGenerator(model, batch=len(batch), max_len=width + max_new_tokens + 1, graphs=graphs)
    tokens = gen.generate([list(row) for row in batch], max_new_tokens).tolist()
    out = []
    for row in tokens:
        cut = next((i for i, t in enumerate(row) if t in stop_ids), len(row))
        out.append(row[:cut])
    return out


def equal_length_batches(lengths: Sequence[int], max_tokens: int, keys: Sequence[Any] | None = None,
                         ragged: bool = False) -> list[list[int]]:
    """Indices grouped into batches of one length (and one ``keys`` value, e.g. the scoring rule), each
    holding at most ``max(1, max_tokens // length)`` prompts; ``max_tokens <= 0``: one prompt per batch.
    ``ragged``: group by ``keys`` alone (lengths may differ within a batch, for
    :func:`static_greedy_generate`), at most ``max_tokens // longest`` prompts per batch. Groups appear
    in order of their first member and keep their members' order, so the batching is a function of the
    prompt list alone."""
    groups: dict[tuple[int, Any], list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault((0 if ragged else int(n), keys[i] if keys is not None else None), []).append(i)
    out = []
    for members in groups.values():
        n = max(int(lengths[i]) for i in members)
        size = max(1, int(max_tokens) // max(1, n)) if max_tokens > 0 else 1
        out += [members[j:j + size] for j in range(0, len(members), size)]
    return out


def left_padded(batch: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both ``[B, max_len]``: each prompt right-aligned, pads masked out."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids):] = torch.tensor(list(ids), dtype=torch.long)
        mask[row, width - len(ids):] = 1
    return input_ids.to(device), mask.to(device)


@torch.inference_mode()
def batched_greedy_generate(model: Any, batch: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: set[int],
                            pad_id: int) -> list[list[int]]:
    """:func:`greedy_generate` for several prompts at once (left padding, positions counted from each
    prompt's first real token), returning each prompt's new tokens. Equal to the one-prompt results up to
    the floating-point effects of batching; prompts of equal length need no padding at all."""
    from runtime_kernels.generate import cache_argument, output_cache

    device, arg = next(model.parameters()).device, cache_argument(model)
    input_ids, mask = left_padded(batch, pad_id, device)  # [B, W]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, W]
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    past, token = output_cache(out), out.logits[:, -1].argmax(-1)  # token: [B]
    stops = torch.tensor(sorted(stop_ids), device=device)
    done = torch.zeros(len(batch), dtype=torch.bool, device=device)
    generated: list[torch.Tensor] = []
    next_pos = positions[:, -1:] + 1  # [B, 1]
    for _ in range(max_new_tokens):
        done |= torch.isin(token, stops)
        if bool(done.all()):
            break
        generated.append(torch.where(done, -1, token))
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos, use_cache=True,
                    **{arg: past})
        past, token, next_pos = output_cache(out), out.logits[:, -1].argmax(-1), next_pos + 1
    return _rows_before_stop(generated, len(batch))
