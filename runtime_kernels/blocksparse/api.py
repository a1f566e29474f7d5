"""Public entry point for block-sparse causal attention: picks the Triton kernel or the reference.

``backend="auto"`` uses ``runtime_kernels.blocksparse.triton`` when the inputs are on CUDA and that module
(and Triton) import; otherwise the PyTorch reference. Both have the signature of
:func:`runtime_kernels.blocksparse.reference.block_sparse_attention`.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Literal

import torch

from runtime_kernels.blocksparse import reference
from runtime_kernels.blocksparse.mask import BlockMask

Backend = Literal["auto", "reference", "triton"]


@functools.lru_cache(maxsize=1)
def _triton_module() -> ModuleType | None:
    """The Triton implementation, or None when it (or triton itself) cannot be imported."""
    try:
        return importlib.import_module("runtime_kernels.blocksparse.triton")
    except ImportError:
        return None


def resolve_backend(q: torch.Tensor, backend: Backend = "auto") -> str:
    """The backend ``block_sparse_attention`` would use for ``q``: ``"triton"`` or ``"reference"``."""
    if backend == "reference":
        return "reference"
    if backend == "triton":
        if _triton_module() is None:
            raise RuntimeError("backend='triton' requested but runtime_kernels.blocksparse.triton "
                               "(or the triton package) is not importable; install triton or use 'reference'")
        return "triton"
    if backend != "auto":
        raise ValueError(f"unknown backend {backend!r}; use 'auto', 'reference' or 'triton'")
    return "triton" if q.is_cuda and _triton_module() is not None else "reference"


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    backend: Backend = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over the kept blocks of ``mask``.

    ``q: [B, Hq, Tq, D]``, ``k: [B, Hkv, Tk, D]``, ``v: [B, Hkv, Tk, Dv]`` -> ``[B, Hq, Tq, Dv]``
    (and ``lse: [B, Hq, Tq]`` with ``return_lse``). See the reference for the exact semantics.
    """
    if resolve_backend(q, backend) == "triton":
        return _triton_module().block_sparse_attention(q, k, v, mask, scale=scale, return_lse=return_lse)
    return reference.block_sparse_attention(q, k, v, mask, scale=scale, return_lse=return_lse)
