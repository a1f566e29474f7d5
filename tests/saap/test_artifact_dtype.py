"""The SAAP artifact stores the classifier weights in a 16-bit model's dtype (calib/saap/artifact.py):
what the runtime serves from it is bit for bit what it served from the float32 weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from calib.saap.artifact import artifact_weight_dtype
from runtime_kernels.saap import SaapDecode, SaapLayerParams
from tests.runtime.saap.test_saap_reference import _params


@pytest.mark.parametrize("model_dtype,stored", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                                (torch.float32, torch.float32), (torch.float64, torch.float32)])
def test_weights_are_stored_in_a_16_bit_models_dtype(model_dtype, stored):
    assert artifact_weight_dtype(SimpleNamespace(dtype=model_dtype)) == stored
    assert artifact_weight_dtype(object()) == torch.float32  # no dtype attribute: float32


def _stored(params: SaapLayerParams, dtype: torch.dtype) -> SaapLayerParams:
    """Through the artifact's tensors and back, as calib writes and the runtime reads them."""
    tensors = params.to("cpu", weight_dtype=dtype).to_tensors(prefix="layers.1.")
    return SaapLayerParams.from_tensors(tensors, sink=params.sink, recent=params.recent, prefix="layers.1.")


def test_bf16_artifact_serves_what_the_float32_one_served_on_a_bf16_model():
    params = _params(4, 2, 16, 8, 32, 1, 8, seed=3)
    stored = _stored(params, torch.bfloat16)
    assert stored.w1.dtype == stored.w2.dtype == torch.bfloat16
    assert stored.centroids.dtype == stored.b1.dtype == torch.float32  # the small tensors keep float32
    dense = SaapLayerParams(sink=1, recent=8, dense=True)
    served = {}
    for name, layer in (("float32 artifact", params), ("bf16 artifact", stored)):
        rt = SaapDecode([dense, layer], top_l=2)
        served[name] = rt._params(1, torch.device("cpu"), torch.bfloat16)
    a, b = served.values()
    for field in SaapLayerParams.TENSOR_FIELDS:
        assert getattr(a, field).dtype == getattr(b, field).dtype
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    # a float32 model upcasts the stored bf16 weights: the same values, exactly representable
    up = SaapDecode([dense, stored], top_l=2)._params(1, torch.device("cpu"), torch.float32)
    assert up.w1.dtype == torch.float32 and torch.equal(up.w1, params.w1.bfloat16().float())
