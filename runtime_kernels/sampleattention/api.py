"""Public SampleAttention prefill entry point: bucket lookup -> two-stage selection -> block-sparse attention.

The selection (:mod:`runtime_kernels.sampleattention.reference`) is plain PyTorch: its cost is the
attention of ``chunk_n * blk`` sampled rows, i.e. matmuls that run on the GPU as they are. The
attention itself goes through :func:`runtime_kernels.blocksparse.api.block_sparse_attention`, which
picks the Triton kernel on CUDA and the PyTorch reference otherwise.
"""

from __future__ import annotations

import torch

from runtime_kernels.blocksparse.api import Backend, block_sparse_attention
from runtime_kernels.blocksparse.mask import BlockMask
from runtime_kernels.sampleattention.buckets import BucketTable
from runtime_kernels.sampleattention.reference import sampleattention_select


def sampleattention_prefill_mask(
    q: torch.Tensor, k: torch.Tensor, table: BucketTable, *, scale: float | None = None
) -> BlockMask:
    """Mask for one layer's prefill: the row of the bucket holding ``Sk`` (the prompt length).

    ``q: [B, Hq, Sq, D]``, ``k: [B, Hkv, Sk, D]`` -> :class:`BlockMask` over ``[B, Hq]``, blocks
    ``table.blk``.
    """
    row = table.lookup(k.shape[2])
    return sampleattention_select(q, k, alpha_c=row.alpha_c, alpha_s=row.alpha_s, chunk_n=row.chunk_n,
                                  blk=table.blk, scale=scale)


def sampleattention_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: BucketTable,
    *,
    scale: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """SampleAttention prefill: ``q: [B, Hq, Sq, D]``, ``k: [B, Hkv, Sk, D]``, ``v: [B, Hkv, Sk, Dv]``
    -> ``[B, Hq, Sq, Dv]`` (causal; queries are the last ``Sq`` positions)."""
    mask = sampleattention_prefill_mask(q, k, table, scale=scale)
    return block_sparse_attention(q, k, v, mask, scale=scale, backend=backend)
