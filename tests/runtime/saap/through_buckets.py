"""SAAP's own index and kernel even where the runtime serves dense attention (ℓ >= C): tests check that path
by ℓ = C through every bucket equalling dense attention."""

from __future__ import annotations

from runtime_kernels.saap import SaapDecode


class SaapThroughBuckets(SaapDecode):
    def reads_every_key(self, layer: int) -> bool:
        return False
