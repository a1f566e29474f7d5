"""SantaDecode: the runtime behind ``hf.apply(model, santa_artifact)`` and the REINFORCE reward episodes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runtime_kernels.errors import ArtifactError
from runtime_kernels.manifest import (DataRecord, Manifest, ModelRecord, ProducerRecord, facts_from_hf_config,
                                      write_artifact)
from runtime_kernels.santa.runtime import SantaDecode
from tests.runtime.small_models import small_llama


def _qkv(b: int = 1, hq: int = 4, hkv: int = 2, tq: int = 1, tk: int = 50, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, tq, d, generator=g) * 2, torch.randn(b, hkv, tk, d, generator=g),
            torch.randn(b, hkv, tk, d, generator=g))


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """float64 softmax attention with GQA (query head h reads KV head h // group), written out here."""
    group = q.shape[1] // k.shape[1]
    k64, v64 = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = q.double() @ k64.transpose(-1, -2) * scale  # [B, Hq, Tq, Tk]
    if causal:
        tq, tk = q.shape[2], k.shape[2]
        allowed = torch.arange(tk)[None, :] <= torch.arange(tk - tq, tk)[:, None]
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v64


def _is_one_value_row(out: torch.Tensor, v: torch.Tensor, group: int, limit: torch.Tensor | None = None) -> bool:
    """Every ``out[b, h, t]`` equals some row ``v[b, h // group, n]`` (with ``n <= limit[t]`` if given)."""
    for b in range(out.shape[0]):
        for h in range(out.shape[1]):
            rows = v[b, h // group]  # [Tk, D]
            for t in range(out.shape[2]):
                hit = torch.isclose(rows, out[b, h, t][None], rtol=1e-5, atol=1e-6).all(-1).nonzero().flatten()
                if hit.numel() == 0 or (limit is not None and int(hit.min()) > int(limit[t])):
                    return False
    return True


def test_decode_uses_each_layers_budget_and_zero_runs_as_one():
    q, k, v = _qkv()  # 50 keys
    rt = SantaDecode([0, 40, 50, 3200], tiling="flash", tile=256, seed=3, stats=True)
    assert rt.method == "santa" and rt.phase == "decode" and rt.prefill(0, q, k, v, 0.3) is None
    assert [rt.budget(layer) for layer in range(4)] == [1, 40, 50, 3200]
    one = rt.decode(0, q, k, v, 0.3)  # S = 1 in a single tile: one sampled value row per head
    assert one.shape == (1, 4, 1, 8) and _is_one_value_row(one, v, group=2)
    forty = rt.decode(1, q, k, v, 0.3)  # 40 draws of 50 keys: sampled, so no single value row
    assert forty.shape == (1, 4, 1, 8) and not _is_one_value_row(forty, v, group=2)
    assert not torch.allclose(forty.double(), _exact(q, k, v, 0.3, causal=False), rtol=0, atol=1e-4)
    assert rt.decode(2, q, k, v, 0.3) is None and rt.decode(3, q, k, v, 0.3) is None  # S covers the keys: dense
    stats = rt.pop_stats()
    assert stats["mean_samples"] == pytest.approx((1 + 40 + 50 + 3200) / 4) and stats["sampled_calls"] == 4
    assert stats["sample_fraction"] == pytest.approx((1 / 50 + 40 / 50 + 1.0 + 1.0) / 4)
    assert rt.pop_stats() == {}


def test_all_layers_signatures_are_kept_and_follow_the_schedule_and_settings():
    """``cost_signatures()`` (what the serving policy asks at each new view) equals the per-layer
    signatures, is kept between calls, and follows a changed schedule or tiling."""
    rt = SantaDecode([0, 40, 40], tiling="flash", tile=256)
    first = rt.cost_signatures()
    assert first == tuple(rt.cost_signature(layer) for layer in range(3)) and rt.cost_signatures() is first
    assert first[1] == first[2] != first[0] and "|S1|" in first[0]
    rt.schedule[2] = 64
    assert rt.cost_signatures()[2] != first[2] and "|S64|" in rt.cost_signatures()[2]
    rt.tiling = "prop"
    assert all("|prop|" in sig for sig in rt.cost_signatures())


def test_static_step_runs_dense_only_where_the_budget_covers_the_view():
    """A static-cache step sees a view longer than its rows' valid keys: S covering the view runs dense for
    every row (counted on the device as reading every key); S below the view samples, even for a row
    whose own valid keys S covers."""
    q, k, v = _qkv(b=2)  # a view of 50 keys
    ctx = SimpleNamespace(cache_len=torch.tensor([30, 50]), attention_mask=None)
    rt = SantaDecode([50, 40], tiling="flash", tile=256, seed=1, stats=True)
    assert rt.decode(0, q, k, v, 0.3, ctx) is None
    assert rt.pop_stats() == {"mean_samples": 50.0, "sample_fraction": 1.0, "sampled_calls": 1.0}
    out = rt.decode(1, q, k, v, 0.3, ctx)
    assert out.shape == (2, 4, 1, 8) and torch.isfinite(out).all()
    assert rt.pop_stats()["sample_fraction"] == pytest.approx((1.0 + 40 / 50) / 2)  # row 0: 40 draws of 30 keys


def test_budget_covering_the_keys_runs_dense_in_prefill_too():
    q, k, v = _qkv(tq=20, tk=20)
    assert SantaDecode([20], phases=["prefill", "decode"]).prefill(0, q, k, v, 0.3) is None
    assert SantaDecode([19], phases=["prefill", "decode"]).prefill(0, q, k, v, 0.3).shape == q.shape


def test_seed_makes_decode_reproducible_and_reseed_restarts():
    """Decode draws are a function of (seed, layer, query position): reproducible for a seed, fresh at
    the next position (one more key in the cache), changed by another seed, restored by reseeding."""
    q, k, v = _qkv(tk=300)
    a = SantaDecode([4], tiling="prop", tile=64, seed=11)
    b = SantaDecode([4], tiling="prop", tile=64, seed=11)
    first = a.decode(0, q, k, v, 0.3)
    assert torch.equal(first, b.decode(0, q, k, v, 0.3))
    assert torch.equal(a.decode(0, q, k, v, 0.3), first)  # the same position draws the same samples
    k2, v2 = torch.cat([k, k[:, :, -1:]], 2), torch.cat([v, v[:, :, -1:]], 2)  # a repeated key: same mass
    a_next = a.offsets(0, torch.tensor([300]), 4, 301, 4, host_position=300)
    assert not torch.equal(a_next[..., :5], a.offsets(0, torch.tensor([299]), 4, 300, 4, host_position=299))
    assert a.decode(0, q, k2, v2, 0.3).shape == first.shape
    a.reseed(12)
    assert not torch.equal(a.decode(0, q, k, v, 0.3), first)
    a.reseed(11)
    assert torch.equal(a.decode(0, q, k, v, 0.3), first)


def test_a_step_starting_after_layer_0_draws_for_its_own_positions():
    """A static step reads its positions from a buffer the loop advances in place, and with layer 0 served
    densely its first sampled layer is a later one: each step's first call must draw for the positions it
    sees now (a CUDA graph captured then computes them), not return the previous step's draws. Expected
    values from keyed_uniforms directly: (seed, layer, position, row, head, slot)."""
    from runtime_kernels.santa.draws import keyed_uniforms

    rt = SantaDecode([300, 4, 4], tiling="flash", tile=64, seed=11)
    pos = torch.tensor([200, 250])
    seen = []
    for _ in range(3):  # three steps in which layers 1 and 2 sample
        seen.append([rt.offsets(layer, pos, 4, 300, 4).clone() for layer in (1, 2)])
        want = keyed_uniforms(11, torch.arange(3), pos, 4, 5)  # 300 keys in tiles of 64: 5 slots
        assert all(torch.equal(got, want[layer]) for got, layer in zip(seen[-1], (1, 2)))
        pos.add_(1)
    assert not torch.equal(seen[0][0], seen[1][0]) and not torch.equal(seen[1][1], seen[2][1])


def test_prefill_samples_causally_when_phases_include_prefill():
    q, k, v = _qkv(tq=20, tk=20)
    rt = SantaDecode([1], phases=["prefill", "decode"], seed=0)
    assert rt.phase == "both"
    out = rt.prefill(0, q, k, v, 0.3)  # S = 1: each query row returns one value row at or before it
    assert out.shape == q.shape and _is_one_value_row(out, v, group=2, limit=torch.arange(20))


def test_padded_batch_decodes_dense():
    q, k, v = _qkv(b=2)
    rt = SantaDecode([2])
    assert rt.decode(0, q, k, v, 0.3, SimpleNamespace(attention_mask=torch.ones(2, 1, 1, 50))) is None
    assert rt.decode(0, q, k, v, 0.3, SimpleNamespace(attention_mask=None)).shape == (2, 4, 1, 8)


@pytest.mark.parametrize("kwargs, match", [
    ({"schedule": [1, -1]}, ">= 0"), ({"schedule": [[1, 2]]}, r"\[L\]"), ({"schedule": [1.5]}, "integers"),
    ({"schedule": [1], "tiling": "flash", "estimator": "iid"}, "sys"), ({"schedule": [1], "tile": 0}, "tile"),
    ({"schedule": [1], "phases": ["prefill"]}, "phases"), ({"schedule": [1], "tiling": "rows"}, "tiling"),
], ids=["negative", "2d", "fraction", "tiled-iid", "tile0", "prefill-only", "tiling"])
def test_constructor_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SantaDecode(**kwargs)


def test_untiled_decode_takes_other_estimators():
    q, k, v = _qkv()
    out = SantaDecode([2], tiling="none", estimator="iid", seed=0).decode(0, q, k, v, 0.3)
    assert out.shape == (1, 4, 1, 8) and torch.isfinite(out).all()


# -------------------------------------------------------------------------------- through hf
@pytest.fixture(scope="module")
def model():
    m = small_llama(seed=0)
    with torch.no_grad():  # sharper attention and larger values than random init: sampling noise shows
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.v_proj.weight.mul_(10.0)
    return m


IDS = (torch.arange(3, 203)[None] * 7) % 300  # 200 prompt tokens


def _prefill_then_decode(model) -> tuple[torch.Tensor, torch.Tensor]:
    from runtime_kernels.generate import cache_argument, output_cache

    with torch.no_grad():
        out = model(input_ids=IDS, use_cache=True)
        step = model(input_ids=torch.tensor([[5]]), use_cache=True, **{cache_argument(model): output_cache(out)})
    return out.logits, step.logits


def _attached(model, rt: SantaDecode) -> tuple[torch.Tensor, torch.Tensor]:
    from runtime_kernels import hf

    hf.attach(model, prefill=rt if rt.phase == "both" else None, decode=rt)
    try:
        return _prefill_then_decode(model)
    finally:
        hf.remove(model)


def test_budget_below_the_keys_is_close_to_dense_and_covering_them_is_dense(model):
    dense_prefill, dense_decode = _prefill_then_decode(model)
    scale = float(dense_decode.abs().max())
    keys = IDS.shape[1] + 1  # the decode step's cache; the prefill's rows read at most one fewer
    for phases in (["decode"], ["prefill", "decode"]):
        pre, dec = _attached(model, SantaDecode([keys - 2, keys - 2], tiling="flash", phases=phases, seed=0))
        assert 0 < float((dec - dense_decode).abs().max()) < 0.06 * scale, phases
        if phases == ["decode"]:
            assert torch.equal(pre, dense_prefill)  # decode only: the prefill is the model's own
        else:
            assert 0 < float((pre - dense_prefill).abs().max()) < 0.1 * float(dense_prefill.abs().max())
        pre, dec = _attached(model, SantaDecode([keys, keys], tiling="flash", phases=phases, seed=0))
        assert torch.equal(pre, dense_prefill) and torch.equal(dec, dense_decode), phases
    _, one = _attached(model, SantaDecode([1, 1], tiling="flash", seed=0))
    assert float((one - dense_decode).abs().max()) > 0.2 * scale


def _artifact(path: Path, model, schedule: list[int], payload: dict) -> Path:
    facts = facts_from_hf_config(model.config, name="rt-llama")
    manifest = Manifest(
        method="santa", abi_version=1, model=ModelRecord(**facts),
        hyperparameters={"N": sum(schedule), "estimator": "sys", "tiling": "flash", "tile": 256, "phases": ["decode"]},
        data=DataRecord(source="synthetic", seed=1, count=1, lengths=[256], content_hash="0" * 64),
        producer=ProducerRecord(package="calib", version="0", git_sha=None, created_at="2026-01-01T00:00:00Z"),
        payload=payload,
    )
    tensors = {"schedule": torch.tensor(schedule, dtype=torch.int64),
               "theta": torch.zeros(len(schedule)), "probs": torch.full((len(schedule),), 1 / len(schedule))}
    return write_artifact(path, manifest, {"schedule": tensors})


def test_apply_reads_the_schedule_and_settings_from_the_artifact(model, tmp_path):
    from runtime_kernels import hf

    dense_prefill, dense_decode = _prefill_then_decode(model)
    payload = {"estimator": "sys", "tiling": "prop", "tile": 64, "phases": ["prefill", "decode"]}
    try:
        state = hf.apply(model, _artifact(tmp_path / "both", model, [3, 5], payload), options={"santa": {"stats": True}})
        rt = state.decode
        assert isinstance(rt, SantaDecode) and state.prefill is rt and rt.phase == "both"
        assert rt.schedule == [3, 5] and (rt.tiling, rt.tile, rt.phases) == ("prop", 64, ("prefill", "decode"))
        pre, dec = _prefill_then_decode(model)
        assert not torch.equal(pre, dense_prefill) and not torch.equal(dec, dense_decode)
        assert rt.pop_stats()["sampled_calls"] == 4  # 2 layers x (prefill + one decode step)
    finally:
        hf.remove(model)
    try:  # hyper-parameters only (no payload): decode only, the model's own prefill
        state = hf.apply(model, _artifact(tmp_path / "decode", model, [2, 2], {}), options={"santa": {"stats": True}})
        assert state.prefill is None and state.decode.phase == "decode" and state.decode.tiling == "flash"
        pre, _ = _prefill_then_decode(model)
        assert torch.equal(pre, dense_prefill)
    finally:
        hf.remove(model)


def test_apply_refuses_a_schedule_for_another_depth(model, tmp_path):
    from runtime_kernels.artifact import load_artifact

    path = _artifact(tmp_path / "bad", model, [2, 2], {})
    art = load_artifact(path)
    art.tensors["schedule"] = torch.tensor([1, 2, 3])
    with pytest.raises(ArtifactError, match="layers"):
        SantaDecode.from_artifact(art, model)


def test_per_row_seeds_draw_what_each_row_draws_alone():
    """With one seed per batch row, decode offsets key on the row's seed, not its index: row b of a batch
    of three equals the single-row draw under seed b, for every layer, head and tile."""
    from runtime_kernels.santa.draws import keyed_uniforms

    seeds, pos = torch.tensor([5, 2**40 + 7, 5]), torch.tensor([300, 17, 301])
    batch = keyed_uniforms(seeds, torch.arange(3), pos, 4, 6)  # [3 layers, 3 rows, 4 heads, 6 tiles]
    for b in range(3):
        alone = keyed_uniforms(int(seeds[b]), torch.arange(3), pos[b:b + 1], 4, 6)
        assert torch.equal(batch[:, b:b + 1], alone)
    assert not torch.equal(batch[:, 0], batch[:, 2])  # same seed, next position: fresh offsets
    with pytest.raises(ValueError, match="one seed per row"):
        keyed_uniforms(seeds[:2], 0, pos, 4, 6)


@pytest.mark.parametrize("tiling", ["prop", "flash", "none"])
def test_per_row_seeds_make_a_batch_sample_like_its_rows(tiling):
    """Prefill and decode of a batch reseeded per row equal each row run alone under its seed."""
    q, k, v = _qkv(b=3, tq=24, tk=24, d=8)
    qd, kd, vd = _qkv(b=3, tq=1, tk=300, d=8, seed=1)
    seeds = [11, 12, 13]
    est = "sys" if tiling != "none" else "iid"
    batched = SantaDecode([3, 5], phases=["prefill", "decode"], tiling=tiling, tile=64, estimator=est)
    batched.reseed(seeds)
    pre = [batched.prefill(layer, q, k, v, 0.3) for layer in (0, 1)]  # two layers: each row's stream goes on
    dec = batched.decode(1, qd, kd, vd, 0.3)
    for b, seed in enumerate(seeds):
        alone = SantaDecode([3, 5], phases=["prefill", "decode"], tiling=tiling, tile=64, estimator=est, seed=seed)
        for layer in (0, 1):
            torch.testing.assert_close(pre[layer][b:b + 1], alone.prefill(layer, q[b:b + 1], k[b:b + 1], v[b:b + 1], 0.3),
                                       rtol=0, atol=1e-6)
        torch.testing.assert_close(dec[b:b + 1], alone.decode(1, qd[b:b + 1], kd[b:b + 1], vd[b:b + 1], 0.3),
                                   rtol=0, atol=1e-6)
    other = SantaDecode([3, 5], phases=["prefill", "decode"], tiling=tiling, tile=64, estimator=est, seed=99)
    assert not torch.allclose(other.prefill(0, q[:1], k[:1], v[:1], 0.3), pre[0][:1])  # the seed matters
    with pytest.raises(ValueError, match="3 per-row seeds for a batch of 2"):
        batched.decode(1, qd[:2], kd[:2], vd[:2], 0.3)


def test_per_row_seeds_through_a_model_equal_one_question_at_a_time():
    """A float64 Llama with S²ANTA in prefill and decode: greedy tokens of three equal-length prompts
    answered as one batch with per-row seeds equal each prompt answered alone under its seed."""
    from calib.generation import equal_length_greedy_generate
    from runtime_kernels import hf

    model = small_llama(seed=2).double()
    rt = SantaDecode([2, 3], phases=["prefill", "decode"], tiling="flash", tile=16)
    prompts = [torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)]
    seeds = [101, 202, 303]
    hf.attach(model, prefill=rt, decode=rt)
    try:
        rt.reseed(seeds)
        together = equal_length_greedy_generate(model, prompts, 12, set())
        alone = []
        for p, s in zip(prompts, seeds):
            rt.reseed(s)
            alone += equal_length_greedy_generate(model, [p], 12, set())
        rt.reseed([7, 8, 9])
        reseeded = equal_length_greedy_generate(model, prompts, 12, set())
    finally:
        hf.remove(model)
    dense = equal_length_greedy_generate(model, prompts, 12, set())
    assert together == alone
    assert reseeded != together and together != dense  # sampling is on and depends on the seeds


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", ["prop", "flash"])
def test_gpu_eager_decode_never_syncs_the_host(tiling):
    """An eager decode step (no ``cache_len``: the REINFORCE reward loop, ``calib eval``) only queues
    kernels, under one seed and under per-row seeds: a host sync per layer would stop the host from
    running ahead of the GPU."""
    q, k, v = (t.cuda() for t in _qkv(b=3, tk=701, d=64))
    rt = SantaDecode([8, 8], tiling=tiling, tile=256)
    for seeds in (5, [1, 2, 3]):
        rt.reseed(seeds)
        rt.decode(0, q, k[:, :, :-1], v[:, :, :-1], 0.125)  # kernels compiled, seed tensor made, outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = rt.decode(0, q, k, v, 0.125)  # a new position: the offsets of every layer are drawn again
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert out.shape == (3, 4, 1, 64) and not bool(out.isnan().any())


def test_int_vectors_outlive_a_longer_request():
    """A view of S or a cache length handed to a captured CUDA graph keeps its memory: asking for a value
    past the cached arange builds a longer one without freeing the first (its address stays valid)."""
    from runtime_kernels.santa import api

    short = api.int_vector(7, 3, torch.device("cpu"))
    base = short.untyped_storage().data_ptr()
    longer = api.int_vector(api._INT_VECTORS["cpu"].numel() + 5, 2, torch.device("cpu"))
    assert longer.untyped_storage().data_ptr() != base
    assert any(t.untyped_storage().data_ptr() == base for t in api._RETIRED_INT_VECTORS)
    assert short.tolist() == [7, 7, 7] and api.int_vector(7, 1, torch.device("cpu")).tolist() == [7]
