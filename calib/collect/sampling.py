"""Per-head sampling of token positions within one prompt (the collector's budgets).

Two modes, both without replacement and independent per head:

* ``reservoir``: a uniform sample of ``k`` of the ``T`` positions, the distribution a reservoir
  sampler over the token stream yields (the whole prompt is in memory, so it is drawn directly);
* ``stratified``: the positions are cut into ``k`` equal strata and one position is drawn uniformly
  in each, so every region of the prompt (sink, middle, recent tokens) is represented.

Seeds derive from (seed, prompt index, layer, kind), so a resumed run draws the same samples.
"""

from __future__ import annotations

import hashlib

import torch

SAMPLING_MODES = ("reservoir", "stratified")


def sample_generator(seed: int, prompt_index: int, layer: int, kind: str) -> torch.Generator:
    """A CPU generator seeded from the sample's identity (stable across runs and processes)."""
    digest = hashlib.sha256(f"{seed}:{prompt_index}:{layer}:{kind}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def sample_positions(num_tokens: int, budget: int, num_heads: int, mode: str, generator: torch.Generator) -> torch.Tensor:
    """Sorted positions per head: [H, min(budget, T)] int64 (all positions when budget >= T)."""
    k = min(int(budget), int(num_tokens))
    if k == num_tokens:
        return torch.arange(num_tokens).expand(num_heads, num_tokens).clone()
    if mode == "reservoir":
        scores = torch.rand(num_heads, num_tokens, generator=generator)  # [H, T]
        return scores.topk(k, dim=1).indices.sort(dim=1).values
    if mode == "stratified":
        edges = torch.arange(k + 1) * num_tokens // k  # [k+1], every stratum at least 1 wide since k <= T
        lo, width = edges[:-1], edges[1:] - edges[:-1]
        offset = (torch.rand(num_heads, k, generator=generator) * width).long()  # [H, k]
        return lo + torch.minimum(offset, width - 1)
    raise ValueError(f"unknown sampling mode {mode!r}: one of {', '.join(SAMPLING_MODES)}")


def gather_heads(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x: [H, T, D]``, ``positions: [H, k]`` -> ``[H, k, D]`` (each head its own positions)."""
    index = positions.to(x.device)[..., None].expand(-1, -1, x.shape[-1])
    return x.gather(1, index)
