"""Compiled decode steps (``StaticGenerator(compile=True)``) against the uncompiled loop and the eager path.

CPU, graphs off (tests/runtime/test_generate_gpu.py replays compiled steps in CUDA graphs). Where the
compiled region ends (graph breaks at the cache write and the attention call) and what it specializes
on (layer index, view length) is dynamo's work whatever the backend, so the default run checks it with
dynamo's ``eager`` backend (seconds); the inductor tests compile C++ kernels (tens of seconds on two
cores) and are marked slow.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch

from runtime_kernels import hf
from runtime_kernels.generate import FlashDecode, StaticGenerator, eager_generate
from runtime_kernels.santa.runtime import SantaDecode
from tests.runtime.saap.through_buckets import SaapThroughBuckets
from tests.runtime.test_generate import C, LAYERS, _model, _prompt, _saap

transformers = pytest.importorskip("transformers")


def _llama(layers: int) -> torch.nn.Module:
    """``tests.runtime.test_generate._model`` with another number of layers."""
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=1024, rope_theta=10000.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval().requires_grad_(False)


def _frames() -> int:
    """Frames dynamo has compiled so far (each compile and recompile counts)."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def _compiles_per_view(gen: StaticGenerator, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[int]]:
    """``gen.generate(ids, steps)`` run as one ``decode`` call per view length; returns the tokens and
    the frames dynamo compiled during each view's steps, in order."""
    t = ids.shape[1]
    gen.prefill(ids)
    views = [-(-(t + 1 + i) // gen.bucket) for i in range(steps)]  # decode step i reads t + 1 + i keys
    chunks, counts = [], []
    for view in sorted(set(views)):
        before = _frames()
        chunks.append(gen.decode(views.count(view)))
        counts.append(_frames() - before)
    return torch.cat(chunks, 1), counts


@pytest.fixture
def eager_backend(monkeypatch):
    """torch.compile with dynamo's ``eager`` backend (the FX graphs run as traced), compile caches reset."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def test_compiled_loop_equals_eager_and_compiles_only_at_the_first_two_views(eager_backend):
    """Nine view lengths: the mask and the cache's views change length at each, the frames do not."""
    model, ids = _model(), _prompt(2, 37)
    want = eager_generate(model, ids, 60)
    gen = StaticGenerator(model, batch=2, max_len=37 + 60, graphs=False, bucket=8, compile=True)
    got, counts = _compiles_per_view(gen, ids, 60)
    assert len(counts) >= 8
    assert torch.equal(got, want)
    # the first view compiles, the second makes the view length dynamic, no later view compiles
    assert counts[0] > 0 and counts[1] > 0 and counts[2:] == [0] * (len(counts) - 2)


class _TracingProbe(FlashDecode):
    """Dense decode attention (SDPA on the CPU) recording, per call, whether dynamo was tracing it."""

    def __init__(self) -> None:
        self.traced: list[bool] = []

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               ctx) -> torch.Tensor | None:
        self.traced.append(torch.compiler.is_compiling())
        return super().decode(layer, q, k, v, scale, ctx)


def test_compile_count_does_not_grow_with_the_number_of_layers(eager_backend):
    """More layers than dynamo's recompile limit (8), calib attention attached (a graph break in every
    layer): were the layer index a guarded constant in the attention frames (or the cache write, which
    indexes the layer's buffer, traced), each would compile once per layer up to the limit, then
    silently run eagerly. The attention runtime itself is never traced."""
    counts = {}
    for layers in (2, 12):
        torch.compiler.reset()
        model, ids, probe = _llama(layers), _prompt(1, 20), _TracingProbe()
        hf.attach(model, decode=probe)
        before = _frames()
        StaticGenerator(model, batch=1, max_len=40, graphs=False, bucket=8, compile=True).generate(ids, 12)
        counts[layers] = _frames() - before
        assert len(probe.traced) == 12 * layers and not any(probe.traced)
    assert counts[2] == counts[12]


def _eager_ops_per_step(gen: StaticGenerator) -> collections.Counter:
    from torch.profiler import profile

    with profile() as prof:
        gen.decode(1)
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def _runtime(name: str):
    if name == "saap":  # ℓ = C through every bucket: the same keys as the eager path
        return SaapThroughBuckets(_saap(top_l=C).layers, top_l=C, stats=False)
    if name == "santa":
        return SantaDecode([3, 2, 5], tiling="flash", tile=16, seed=7, backend="reference")
    return None


# (batch, prompt, steps, bucket) as in test_generate's static-loop tests (SAAP's exactly), with more steps
# for dense and SANTA so that every case crosses at least three view lengths
SETUPS = {"dense": (2, 37, 60, 8), "saap": (2, 60, 24, 8), "santa": (2, 50, 40, 16)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SETUPS))
def test_inductor_compiled_loop_equals_uncompiled_and_eager(name: str):
    """float32, several views: the compiled loop's tokens equal the uncompiled loop's and transformers'
    eager path; no frame compiles after the second view; the model's own element-wise work (the MLP's
    SiLU, one per layer uncompiled) runs inside compiled kernels, the cache writes outside them."""
    b, t, steps, bucket = SETUPS[name]
    model, ids = _model(), _prompt(b, t)
    if _runtime(name) is not None:
        hf.attach(model, decode=_runtime(name))
    want = eager_generate(model, ids, steps)
    tokens, counts, ops = {}, {}, {}
    for compiled in (False, True):
        if _runtime(name) is not None:
            hf.attach(model, decode=_runtime(name))  # fresh state (SAAP's index)
        gen = StaticGenerator(model, batch=b, max_len=t + steps + 1, graphs=False, bucket=bucket, compile=compiled)
        tokens[compiled], counts[compiled] = _compiles_per_view(gen, ids, steps)
        ops[compiled] = _eager_ops_per_step(gen)
    hf.remove(model)
    assert torch.equal(tokens[False], want) and torch.equal(tokens[True], want)
    assert len(counts[True]) >= 3 and counts[True][2:] == [0] * (len(counts[True]) - 2)
    assert ops[False]["aten::silu"] == LAYERS and ops[True]["aten::silu"] == 0
    assert ops[True]["aten::scatter_"] == 2 * LAYERS  # the cache writes (each row at its position) run eagerly, between graphs
