"""SANTA public API: argument checks, randomness plumbing, backend dispatch."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from runtime_kernels.santa import api, normalize_num_samples, santa_attention, santa_decode_attention
from runtime_kernels.santa import reference


def _qkv(b=1, hq=4, hkv=2, tq=3, tk=5, d=4):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, hq, tq, d, generator=g), torch.randn(b, hkv, tk, d, generator=g),
            torch.randn(b, hkv, tk, d, generator=g))


def test_generator_reproducible():
    q, k, v = _qkv()
    for est in ("iid", "strat", "sys"):
        a = santa_attention(q, k, v, 7, estimator=est, generator=torch.Generator().manual_seed(5))
        b = santa_attention(q, k, v, 7, estimator=est, generator=torch.Generator().manual_seed(5))
        assert torch.equal(a, b)
    d1 = santa_decode_attention(q[:, :, -1], k, v, 7, tile=2, generator=torch.Generator().manual_seed(5))
    d2 = santa_decode_attention(q[:, :, -1], k, v, 7, tile=2, generator=torch.Generator().manual_seed(5))
    assert torch.equal(d1, d2)


def test_normalize_num_samples():
    assert normalize_num_samples(0, 3, torch.device("cpu")).tolist() == [1, 1, 1]
    assert normalize_num_samples(torch.tensor(4), 2, torch.device("cpu")).tolist() == [4, 4]
    assert normalize_num_samples(torch.tensor([0, 9]), 2, torch.device("cpu")).tolist() == [1, 9]
    assert normalize_num_samples(8.0, 1, torch.device("cpu")).tolist() == [8]
    with pytest.raises(ValueError, match="integers"):
        normalize_num_samples(2.5, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"\[B\]"):
        normalize_num_samples(torch.tensor([1, 2, 3]), 2, torch.device("cpu"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"estimator": "topk"}, "unknown estimator"),
        ({"uniforms": torch.full((1, 4, 3), 1.0)}, r"\[0, 1\)"),
        ({"uniforms": torch.full((1, 4, 3), -0.1)}, r"\[0, 1\)"),
        ({"estimator": "strat", "uniforms": torch.rand(1, 4, 3)}, "shape"),
    ],
    ids=["estimator", "u=1", "u<0", "strat-shape"],
)
def test_prefill_argument_errors(kwargs, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        santa_attention(q, k, v, 4, **kwargs)


def test_shape_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="multiple of KV heads"):
        santa_attention(q[:, :3], k, v, 4)
    with pytest.raises(ValueError, match="Tq <= Tk"):
        santa_attention(torch.randn(1, 4, 6, 4), k, v, 4)
    with pytest.raises(ValueError, match="same shape"):
        santa_attention(q, k, v[:, :, :4], 4)
    with pytest.raises(ValueError, match="cache_len"):
        santa_decode_attention(q[:, :, 0], k, v, 4, cache_len=torch.tensor([0]))
    with pytest.raises(ValueError, match="cache_len"):
        santa_decode_attention(q[:, :, 0], k, v, 4, cache_len=torch.tensor([6]))
    with pytest.raises(ValueError, match="one query per row"):
        santa_decode_attention(q, k, v, 4)
    with pytest.raises(ValueError, match="unknown tiling"):
        santa_decode_attention(q[:, :, 0], k, v, 4, tiling="block")
    with pytest.raises(ValueError, match="not tile_uniforms"):
        santa_decode_attention(q[:, :, 0], k, v, 4, tiling="none", tile_uniforms=torch.rand(1, 4, 1))
    with pytest.raises(ValueError, match="not uniforms"):
        santa_decode_attention(q[:, :, 0], k, v, 4, tiling="prop", uniforms=torch.rand(1, 4, 1))


def test_backend_selection_on_cpu():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="triton"):
        santa_attention(q, k, v, 4, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        santa_attention(q, k, v, 4, backend="cuda")
    u = torch.rand(1, 4, 3)
    assert torch.equal(santa_attention(q, k, v, 4, uniforms=u, backend="reference"),
                       santa_attention(q, k, v, 4, uniforms=u))


def test_triton_module_plugs_in(monkeypatch):
    fake = types.SimpleNamespace(santa_prefill_forward=lambda *a, **kw: "triton")
    monkeypatch.setattr(api, "_triton_module", lambda: fake)
    cuda = torch.device("cuda")
    assert api.backend_function("santa_prefill_forward", cuda, "auto")() == "triton"
    # A function the GPU module lacks, a CPU tensor, or backend="reference" use the reference.
    assert api.backend_function("santa_decode_forward", cuda, "auto") is reference.santa_decode_forward
    ref = reference.santa_prefill_forward
    assert api.backend_function("santa_prefill_forward", torch.device("cpu"), "auto") is ref
    assert api.backend_function("santa_prefill_forward", cuda, "reference") is ref


def test_missing_triton_is_not_an_error_but_a_bug_is(monkeypatch):
    def raise_missing(name):
        def _import(_):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return _import

    for missing, ok in (("triton", True), ("runtime_kernels.santa.triton", True), ("numpyy", False)):
        api._triton_module.cache_clear()
        monkeypatch.setattr(api.importlib, "import_module", raise_missing(missing))
        if ok:
            assert api._triton_module() is None
        else:
            with pytest.raises(ModuleNotFoundError):
                api._triton_module()
    api._triton_module.cache_clear()


def test_import_pulls_in_no_calib_stack():
    code = (
        "import sys, runtime_kernels.santa\n"
        "bad = [m for m in ('hydra', 'mlflow', 'calib') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
