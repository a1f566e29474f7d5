"""Public SALE entry points: the Selection-Pass and SALE prefill attention, dispatching by device.

``backend="auto"`` uses ``runtime_kernels.sale.triton`` (Selection-Pass) when the inputs are on CUDA and that
module imports, otherwise the PyTorch reference; the attention itself goes through
:func:`runtime_kernels.blocksparse.api.block_sparse_attention`, which dispatches the same way.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Literal

import torch

from runtime_kernels.blocksparse import api as blocksparse_api
from runtime_kernels.blocksparse.mask import BlockMask
from runtime_kernels.sale import reference
from runtime_kernels.sale.reference import SaleSelectionConfig

Backend = Literal["auto", "reference", "triton"]


@functools.lru_cache(maxsize=1)
def _triton_module() -> ModuleType | None:
    try:
        return importlib.import_module("runtime_kernels.sale.triton")
    except ImportError:
        return None


def _impl(q: torch.Tensor, backend: Backend) -> ModuleType:
    if backend == "reference":
        return reference
    if backend == "triton":
        if _triton_module() is None:
            raise RuntimeError("backend='triton' requested but runtime_kernels.sale.triton (or triton) "
                               "is not importable; install triton or use backend='reference'")
        return _triton_module()
    if backend != "auto":
        raise ValueError(f"unknown backend {backend!r}; use 'auto', 'reference' or 'triton'")
    return _triton_module() if q.is_cuda and _triton_module() is not None else reference


def sale_block_scores(q: torch.Tensor, k: torch.Tensor, *, config: SaleSelectionConfig = SaleSelectionConfig(),
                      scale: float | None = None, backend: Backend = "auto") -> torch.Tensor:
    """``q: [B, Hq, Tq, D]``, ``k: [B, Hkv, Tk, D]`` -> ``[B, Hq, NQ, NK]`` block scores ``ln max P~``
    (``+inf`` sink/local, ``-inf`` non-causal); tau-independent, threshold with ``select_blocks``."""
    return _impl(q, backend).sale_block_scores(q, k, config=config, scale=scale)


def sale_select(q: torch.Tensor, k: torch.Tensor, tau: torch.Tensor | float, *,
                config: SaleSelectionConfig = SaleSelectionConfig(), scale: float | None = None,
                backend: Backend = "auto") -> BlockMask:
    """Selection-Pass: ``tau: [Hq]`` (or one float) -> BlockMask over (B, Hq, query block)."""
    scores = sale_block_scores(q, k, config=config, scale=scale, backend=backend)
    return reference.select_blocks(scores, tau, seq_q=q.shape[2], seq_k=k.shape[2],
                                   block_q=config.block_q, block_k=config.block_k)


def sale_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tau: torch.Tensor | float, *,
                           config: SaleSelectionConfig = SaleSelectionConfig(), scale: float | None = None,
                           backend: Backend = "auto") -> torch.Tensor:
    """SALE prefill: select blocks with ``tau: [Hq]``, then block-sparse causal attention.

    ``q: [B, Hq, Tq, D]``, ``k, v: [B, Hkv, Tk, D]`` -> ``[B, Hq, Tq, Dv]``.
    """
    mask = sale_select(q, k, tau, config=config, scale=scale, backend=backend)
    return blocksparse_api.block_sparse_attention(q, k, v, mask, scale=scale, backend=backend)
