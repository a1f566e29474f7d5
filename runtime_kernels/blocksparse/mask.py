"""The one block-sparse mask format of the project (docs/methods.md, Shared machinery).

Queries are cut into blocks of ``block_q`` rows and keys into blocks of ``block_k`` columns. For
every (batch, head, query block) the mask lists the kept key-block indices, sorted ascending, in
compressed-sparse-row form over all rows at once:

* row ``r = (b * H + h) * NQ + qb`` owns ``indices[offsets[r] : offsets[r + 1]]``;
* ``offsets: [B * H * NQ + 1]`` int64, ``indices: [>= nnz]`` int32 (``nnz = offsets[-1]``; a GPU selector
  that must not synchronize allocates the worst case, and only ``indices[:nnz]`` is meaningful).

One flat CSR (rather than a padded ``[B, H, NQ, max]`` table) keeps storage proportional to the kept
blocks and lets a kernel program per (b, h, qb) read its two row pointers and walk its list.

Queries are the *last* ``seq_q`` positions of the ``seq_k`` keys (prefill: ``seq_q == seq_k``), so
query ``i`` sits at absolute position ``seq_k - seq_q + i`` and may attend keys ``<=`` that position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockMask:
    """CSR block mask; see the module docstring for the layout."""

    offsets: torch.Tensor  # [B*H*NQ + 1] int64 row pointers
    indices: torch.Tensor  # [>= nnz] int32 kept key-block indices, ascending within a row
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    block_q: int
    block_k: int

    @property
    def num_q_blocks(self) -> int:
        return _ceil_div(self.seq_q, self.block_q)

    @property
    def num_k_blocks(self) -> int:
        return _ceil_div(self.seq_k, self.block_k)

    def counts(self) -> torch.Tensor:
        """Kept key blocks per row: ``[B, H, NQ]`` int64."""
        return (self.offsets[1:] - self.offsets[:-1]).view(self.batch, self.heads, self.num_q_blocks)

    @classmethod
    def from_dense(cls, keep: torch.Tensor, seq_q: int, seq_k: int, block_q: int, block_k: int) -> "BlockMask":
        """Build from a boolean block table ``keep: [B, H, NQ, NK]`` (True = compute the block).

        Blocks that lie entirely above the causal diagonal are dropped whatever ``keep`` says.
        """
        b, h, nq, nk = keep.shape
        if nq != _ceil_div(seq_q, block_q) or nk != _ceil_div(seq_k, block_k):
            raise ValueError(
                f"block table {tuple(keep.shape)} does not fit seq_q={seq_q}, seq_k={seq_k} "
                f"with blocks {block_q}x{block_k}"
            )
        keep = keep.bool() & causal_block_mask(seq_q, seq_k, block_q, block_k, keep.device)
        counts = keep.reshape(-1, nk).sum(-1)  # [B*H*NQ]
        offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=keep.device)
        offsets[1:] = torch.cumsum(counts, 0)
        indices = keep.reshape(-1, nk).nonzero()[:, 1].to(torch.int32)  # row-major => sorted per row
        return cls(offsets, indices, b, h, seq_q, seq_k, block_q, block_k)

    @classmethod
    def full(cls, batch: int, heads: int, seq_q: int, seq_k: int, block_q: int, block_k: int,
             device: torch.device | str | None = None) -> "BlockMask":
        """Every causal block kept (dense causal attention in this format)."""
        causal = causal_block_mask(seq_q, seq_k, block_q, block_k, device)
        return cls.from_dense(causal.expand(batch, heads, -1, -1), seq_q, seq_k, block_q, block_k)

    def to_dense(self) -> torch.Tensor:
        """Boolean block table ``[B, H, NQ, NK]``."""
        nq, nk = self.num_q_blocks, self.num_k_blocks
        rows = torch.repeat_interleave(
            torch.arange(self.batch * self.heads * nq, device=self.offsets.device), self.offsets[1:] - self.offsets[:-1]
        )
        keep = torch.zeros(self.batch * self.heads * nq, nk, dtype=torch.bool, device=self.offsets.device)
        keep[rows, self.indices[: rows.numel()].long()] = True
        return keep.view(self.batch, self.heads, nq, nk)

    def token_mask(self) -> torch.Tensor:
        """Element-level boolean mask ``[B, H, seq_q, seq_k]``: kept block AND causal (for references)."""
        keep = self.to_dense()
        elem = keep.repeat_interleave(self.block_q, 2)[:, :, : self.seq_q]
        elem = elem.repeat_interleave(self.block_k, 3)[..., : self.seq_k]
        qpos = torch.arange(self.seq_q, device=elem.device) + (self.seq_k - self.seq_q)
        kpos = torch.arange(self.seq_k, device=elem.device)
        return elem & (kpos[None, :] <= qpos[:, None])

    def density(self) -> torch.Tensor:
        """Kept blocks / causal blocks, per (b, h): ``[B, H]`` float. ``1 - density`` is sparsity."""
        causal = causal_block_mask(self.seq_q, self.seq_k, self.block_q, self.block_k, self.offsets.device).sum()
        return self.counts().sum(-1).float() / causal.float()

    def to(self, device: torch.device | str) -> "BlockMask":
        return BlockMask(self.offsets.to(device), self.indices.to(device), self.batch, self.heads,
                         self.seq_q, self.seq_k, self.block_q, self.block_k)


def causal_block_mask(seq_q: int, seq_k: int, block_q: int, block_k: int,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """``[NQ, NK]`` bool: key block ``j`` holds at least one key visible to some query of block ``i``.

    The last query of block ``i`` sits at ``seq_k - seq_q + min((i + 1) * block_q, seq_q) - 1``; key block
    ``j`` starts at ``j * block_k``.
    """
    nq, nk = _ceil_div(seq_q, block_q), _ceil_div(seq_k, block_k)
    last_q = (seq_k - seq_q) + torch.clamp(torch.arange(1, nq + 1, device=device) * block_q, max=seq_q) - 1
    first_k = torch.arange(nk, device=device) * block_k
    return first_k[None, :] <= last_q[:, None]


def causal_block_count(seq_q: int, seq_k: int, block_q: int, block_k: int) -> int:
    """Causal blocks of one (batch, head), ``causal_block_mask(...).sum()`` in host arithmetic (no device
    work): the worst-case ``nnz`` per head a selector allocates ``indices`` for without a host sync."""
    nq = _ceil_div(seq_q, block_q)
    return sum((seq_k - seq_q + min((i + 1) * block_q, seq_q) - 1) // block_k + 1 for i in range(nq))
