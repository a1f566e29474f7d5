"""Public SALE entry points: the Selection-Pass and SALE prefill attention, dispatching by device.

``backend="auto"`` uses ``runtime_kernels.sale.triton`` (Selection-Pass) when the inputs are on CUDA and that
module imports, otherwise the PyTorch reference; the attention itself goes through
:func:`runtime_kernels.blocksparse.api.block_sparse_attention`, which dispatches the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from types import ModuleType
from typing import Any, Literal

import torch

from runtime_kernels.blocksparse import api as blocksparse_api
from runtime_kernels.blocksparse.mask import BlockMask
from runtime_kernels.errors import ArtifactError
from runtime_kernels.ragged import padded_rows, rows_alone
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


def estimator_precision(config: SaleSelectionConfig, device: torch.device | str,
                        backend: Backend = "auto") -> str:
    """The Selection-Pass estimate that actually runs for ``config`` on ``device``: the reference honours
    ``config.precision`` (``"int4"``, ``"int8"``, ``"float"``); the Triton path (CUDA) has no 4-bit
    tensor-core route and runs ``"int8"`` for a 4- or 8-bit config."""
    probe = torch.empty(0, device=device)
    impl = _impl(probe, backend)
    return impl.gpu_estimator(config) if impl is not reference else config.precision


def sale_block_scores(q: torch.Tensor, k: torch.Tensor, *, config: SaleSelectionConfig = SaleSelectionConfig(),
                      scale: float | None = None, backend: Backend = "auto") -> torch.Tensor:
    """``q: [B, Hq, Tq, D]``, ``k: [B, Hkv, Tk, D]`` -> ``[B, Hq, NQ, NK]`` block scores ``ln max P~``
    (``+inf`` sink/local, ``-inf`` non-causal); tau-independent, threshold with ``select_blocks``."""
    return _impl(q, backend).sale_block_scores(q, k, config=config, scale=scale)


def sale_select(q: torch.Tensor, k: torch.Tensor, tau: torch.Tensor | float, *,
                config: SaleSelectionConfig = SaleSelectionConfig(), scale: float | None = None,
                backend: Backend = "auto") -> BlockMask:
    """Selection-Pass: ``tau: [Hq]`` (or one float) -> BlockMask over (B, Hq, query block).

    The Triton path (CUDA) selects and builds the mask on the device without a host sync (int8 estimate
    for a 4- or 8-bit config; ``mask.indices`` sized for every causal block, ``offsets`` exact)."""
    impl = _impl(q, backend)
    if impl is not reference:
        return impl.sale_select(q, k, tau, block_q=config.block_q, block_k=config.block_k, sink=config.sink,
                                local=config.local, bits=config.bits, smooth_k=config.smooth_k, scale=scale)
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


def _selection_config(artifact: Any) -> SaleSelectionConfig:
    """The Selection-Pass config an artifact recorded: ``payload["selection"]`` (``SaleSelectionConfig
    .to_dict()``), else the hyper-parameters of the same names."""
    manifest = artifact.manifest
    stored = dict(manifest.payload.get("selection") or manifest.hyperparameters or {})
    names = {f.name for f in dataclasses.fields(SaleSelectionConfig)}
    try:
        return SaleSelectionConfig(**{k: v for k, v in stored.items() if k in names})
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"{artifact.path}: invalid SALE selection config {stored} ({exc})") from None


class SalePrefill:
    """SALE as a prefill runtime for :func:`runtime_kernels.hf.apply` / ``hf.attach``.

    Per layer ``l`` the query heads use the thresholds ``tau[l]: [Hq]`` (0 = dense head). A layer whose
    thresholds are all 0 returns ``None``, so the model's own dense attention runs unchanged (bitwise
    the dense model); otherwise the Selection-Pass picks blocks and :func:`block_sparse_attention`
    computes the exact softmax over them. Decode is not touched (SALE is a prefill method).

    ``pop_stats()`` returns ``{"density", "sparsity"}``: kept / causal blocks averaged over every
    (layer, batch row, query head) since the previous call (a dense layer counts as density 1), summed on
    the device (no host sync per layer) when ``stats`` is on; ``{}`` with it off (serving).
    """

    method = "sale"
    phase = "prefill"
    ragged_prefill = True  # takes rows padded after their last token (``ctx.lengths``), each row as alone

    def __init__(self, tau: torch.Tensor, config: SaleSelectionConfig = SaleSelectionConfig(), *,
                 backend: Backend = "auto", stats: bool = True) -> None:
        """``tau: [L, Hq]`` thresholds in ``[0, 1]``."""
        tau = torch.as_tensor(tau, dtype=torch.float32).detach().cpu()
        if tau.dim() != 2 or bool(((tau < 0) | (tau > 1) | tau.isnan()).any()):
            raise ValueError(f"tau must be an [L, Hq] tensor with values in [0, 1]; got shape {tuple(tau.shape)}")
        self.tau = tau
        self.config = config
        self.backend = backend
        self._dense_layers = [bool((row == 0).all()) for row in tau]
        self._on_device: dict[str, torch.Tensor] = {}
        self.stats = stats
        self._dense_heads = 0  # (layer, row, head) entries of dense layers since the last pop_stats
        self._density_sum: torch.Tensor | None = None  # the sparse layers' densities, summed on the device
        self._count = 0

    @classmethod
    def from_artifact(cls, artifact: Any, model: Any, *, stats: bool = False) -> "SalePrefill":
        """Build from a verified SALE artifact (tensor ``tau: [L, Hq]``) for ``model``. ``stats`` is off
        for serving (``hf.apply``'s default); ``calib eval`` turns it on."""
        tau = artifact.tensor("tau")
        cfg = getattr(model, "config", None)
        want = (getattr(cfg, "num_hidden_layers", tau.shape[0]), getattr(cfg, "num_attention_heads", tau.shape[-1]))
        if tau.dim() != 2 or tuple(tau.shape) != tuple(want):
            raise ArtifactError(f"{artifact.path}: tau has shape {tuple(tau.shape)} but the model has "
                                f"{want[0]} layers x {want[1]} query heads; use an artifact calibrated for this model")
        return cls(tau, _selection_config(artifact), stats=stats)

    def _tau_row(self, layer: int, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = self.tau.to(device)
        return self._on_device[key][layer]

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                ctx: Any = None) -> torch.Tensor | None:
        """``q: [B, Hq, T, D]``, ``k, v: [B, Hkv, T, D]`` (RoPE'd) -> ``[B, Hq, T, Dv]``, or ``None``
        (run the model's dense attention) when every threshold of ``layer`` is 0. With ``ctx.lengths``
        (rows padded after their last token) each row runs alone (:mod:`runtime_kernels.ragged`), unless the
        layer is dense, which the padding cannot change."""
        if layer >= self.tau.shape[0] or q.shape[1] != self.tau.shape[1]:
            raise ValueError(f"SALE thresholds are [{self.tau.shape[0]}, {self.tau.shape[1]}]; "
                             f"got layer {layer} with {q.shape[1]} query heads")
        heads = q.shape[0] * q.shape[1]
        if self._dense_layers[layer]:
            if self.stats:
                self._dense_heads += heads
                self._count += heads
            return None
        lengths = padded_rows(ctx, q)
        if lengths is not None:
            return rows_alone(self.prefill, layer, q, k, v, scale, lengths)
        mask = sale_select(q, k, self._tau_row(layer, q.device), config=self.config, scale=scale,
                           backend=self.backend)
        if self.stats:
            density = mask.density().double().sum()  # [B, Hq] summed, left on the device
            self._density_sum = density if self._density_sum is None else self._density_sum + density
            self._count += heads
        return blocksparse_api.block_sparse_attention(q, k, v, mask, scale=scale, backend=self.backend)

    def pop_stats(self) -> dict[str, float]:
        """Mean block density / sparsity since the last call (``{}`` when no prefill ran)."""
        if self._count == 0:
            return {}
        measured = 0.0 if self._density_sum is None else float(self._density_sum)
        density = (measured + self._dense_heads) / self._count
        self._density_sum, self._dense_heads, self._count = None, 0, 0
        return {"density": density, "sparsity": 1.0 - density}
