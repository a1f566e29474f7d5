"""Block-sparse causal attention shared by SALE and SampleAttention (SPEC §5.3 mask format)."""

from runtime_kernels.blocksparse.mask import BlockMask, causal_block_mask

__all__ = ["BlockMask", "causal_block_mask"]
