"""Block-sparse causal attention shared by SALE and SampleAttention (docs/methods.md, Shared machinery)."""

from runtime_kernels.blocksparse.mask import BlockMask, causal_block_mask

__all__ = ["BlockMask", "causal_block_mask"]
