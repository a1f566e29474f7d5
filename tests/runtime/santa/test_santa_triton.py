"""S²ANTA Triton decode kernels (prop, flash) against the PyTorch reference.

Interpreter tests (CPU, float32, tiny shapes) run the kernels under ``TRITON_INTERPRET=1``; the ``gpu``
tests repeat the checks at 8k-32k keys in bf16 / fp16 and test the estimator's mean over many draws.

Counts: with the offsets fixed the kernels draw what the reference draws, except (a) keys next to a
cumulative boundary ``x_n = S_t·C_n/Z - u_t`` that lies within ``COUNT_TOL·S_t`` of an integer (the
kernel's float32 scores / exp move ``x_n`` by ~1e-7·S_t·|s|; 1e-5 leaves a 10-100× margin), flagged from
the reference's float64 cumulative sums, and (b) for prop, heads whose budget apportionment is itself
within rounding: a quota within ``QUOTA_TOL·max(q, 1)`` of an integer, or two fractional parts at the
largest-remainder cut closer than that (the kernel's float32 tile statistics move quotas by ~2e-6·q;
it ranks fractional parts on a 2^-20 grid, hence an absolute 2^-19 on top).
"""

from __future__ import annotations

import math

import pytest
import torch

from runtime_kernels.santa import reference
from runtime_kernels.santa.tiling import flash_tile_budget, num_tiles, tile_statistics

tk = pytest.importorskip("runtime_kernels.santa.triton")
triton_flash = pytest.importorskip("runtime_kernels.santa.triton_flash")
_triton_support = pytest.importorskip("runtime_kernels._triton_support")

F64 = torch.float64
COUNT_TOL = 1e-5
QUOTA_TOL = 1e-5


# ----------------------------------------------------------------------------- independent helpers


def _problem(seed, *, b=2, hq=8, hkv=2, tk=700, d=64, sharp=2.5, dtype=torch.float32, device="cpu"):
    """Random decode inputs whose scaled scores q·k/√d are ~N(0, sharp²) (peaked softmax rows)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, d, generator=g) * sharp).to(dtype=dtype, device=device)
    k = torch.randn(b, hkv, tk, d, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(b, hkv, tk, d, generator=g).to(dtype=dtype, device=device)
    return q, k, v


def _offsets(seed, b, hq, tk, tile, device="cpu"):
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.rand(b, hq, -(-tk // tile), generator=g, dtype=F64).to(device)


def _tile_weights(q, k, scale, cache_len, tile):
    """Reference in-tile weights u [B,Hq,T,tile], masses [B,Hq,T], tile_valid [B,T] (float64, tiling.py)."""
    b, hq, d = q.shape
    hkv, tkeys = k.shape[1], k.shape[2]
    s = torch.einsum("bkgd,bknd->bkgn", q.float().view(b, hkv, hq // hkv, d), k.float()) * scale
    key_valid = torch.arange(tkeys, device=q.device)[None, :] < cache_len[:, None]
    return tile_statistics(s.reshape(b, hq, tkeys).to(F64), key_valid, tile)


def _boundary_keys(u, budgets, offsets, tk):
    """[B, Hq, Tk] bool: keys whose count may move by float rounding (module docstring, case a)."""
    cum = u.cumsum(-1)
    z = cum[..., -1:].clamp_min(torch.finfo(F64).tiny)
    st = budgets[..., None].to(F64)
    x = st * cum / z - offsets[..., None]
    x_prev = torch.cat([-offsets[..., None], x[..., :-1]], dim=-1)

    def near(y):
        return (y - y.round()).abs() < COUNT_TOL * st.clamp_min(1)

    flagged = near(x) | near(x_prev)
    return flagged.reshape(*u.shape[:2], -1)[..., :tk]


def _ambiguous_heads(mass, num_samples, tile_valid):
    """[B, Hq] bool: prop budgets within rounding of another apportionment (module docstring, case b)."""
    quota = mass * num_samples.to(F64)[:, None, None]
    tol = QUOTA_TOL * quota + 2.0 ** -19  # relative error of the kernel's masses + its 2^-20 rank grid
    valid = tile_valid[:, None, :].expand_as(quota)
    # A quota near an integer k >= 1 may be floored to k - 1 (near 0 it can't go below 0).
    near_int = (((quota - quota.round()).abs() < tol) & (quota.round() >= 1) & valid).any(-1)
    frac = torch.where(valid, quota - quota.floor(), torch.full_like(quota, -1.0))
    rest = num_samples[:, None] - torch.where(valid, quota.floor(), torch.zeros_like(quota)).sum(-1).long()
    order = frac.sort(-1, descending=True)
    n_valid = valid.sum(-1)
    lo = (rest - 1).clamp(0, frac.shape[-1] - 1)
    hi = rest.clamp(0, frac.shape[-1] - 1)
    gap = order.values.gather(-1, lo[..., None]) - order.values.gather(-1, hi[..., None])
    tol_cut = tol.gather(-1, order.indices.gather(-1, lo[..., None])) + tol.gather(
        -1, order.indices.gather(-1, hi[..., None]))
    cut_tie = (gap < tol_cut)[..., 0] & (rest > 0) & (rest < n_valid)
    return (near_int | cut_tie) & (n_valid > 1)  # one valid tile always gets all S samples


def _expected_from_counts(counts, v, num_samples, tiling, mass, tile, cache_len):
    """The estimate the reference forms from given counts [B,Hq,Tk] (float64): O = Σ_n weight_n V_n."""
    b, hq, tkeys = counts.shape
    hkv = v.shape[1]
    if tiling == "prop":
        per_key = counts.to(F64) / num_samples.to(F64)[:, None, None]
    else:
        s_tile = flash_tile_budget(num_samples, num_tiles(cache_len, tile)).to(F64)
        per_tile = (mass / s_tile[:, None, None]).repeat_interleave(tile, dim=-1)[..., :tkeys]
        per_key = counts.to(F64) * per_tile
    keep = torch.arange(tkeys, device=v.device)[None, :] < cache_len[:, None]
    vv = torch.where(keep[:, None, :, None], v.to(F64), torch.zeros((), dtype=F64, device=v.device))
    w = per_key.view(b, hkv, hq // hkv, tkeys)
    return torch.einsum("bkgn,bknd->bkgd", w, vv).reshape(b, hq, -1)


def _check_draws(q, k, v, num_samples, offsets, cache_len, *, tiling, tile, out_rtol, keep=None):
    """Kernel counts / budgets / output vs the reference; returns the fraction of flagged keys
    (``keep``, a dict, receives the kernel's ``drawn`` samples and ``out``put)."""
    scale = q.shape[-1] ** -0.5
    drawn = tk.decode_samples(q, k, num_samples, tiling=tiling, tile=tile, scale=scale,
                              tile_uniforms=offsets, cache_len=cache_len)
    ref = reference.decode_samples(q, k, num_samples, tiling=tiling, tile=tile, scale=scale,
                                   tile_uniforms=offsets, cache_len=cache_len)
    u, mass, tile_valid = _tile_weights(q, k, scale, cache_len, tile)
    heads_ok = torch.ones(mass.shape[:2], dtype=torch.bool, device=q.device)
    if tiling == "prop":
        heads_ok = ~_ambiguous_heads(mass, num_samples, tile_valid)
        assert heads_ok.float().mean() > 0.9, "test inputs too close to budget ties to be informative"
    assert torch.equal(drawn.tile_budgets[heads_ok], ref.tile_budgets[heads_ok])
    # Every tile draws exactly its own budget (both backends, always).
    t_all = mass.shape[-1]
    pad = t_all * tile - k.shape[2]
    per_tile = torch.nn.functional.pad(drawn.counts, (0, pad)).view(*drawn.counts.shape[:2], t_all, tile)
    assert torch.equal(per_tile.sum(-1), drawn.tile_budgets)
    flagged = _boundary_keys(u, ref.tile_budgets, offsets, k.shape[2])
    same = (drawn.counts == ref.counts) | flagged
    assert same[heads_ok].all(), f"{int((~same[heads_ok]).sum())} keys differ away from a boundary"
    assert (drawn.counts >= 0).all()
    # Output = the reference's estimate formed from the kernel's own counts.
    out = tk.santa_decode_forward(q, k, v, num_samples, tiling=tiling, tile=tile, estimator="sys",
                                  scale=scale, uniforms=offsets, cache_len=cache_len)
    assert out.dtype == q.dtype and out.shape == q.shape and torch.isfinite(out).all()
    want = _expected_from_counts(drawn.counts, v, num_samples, tiling, mass, tile, cache_len)
    err = (out.to(F64) - want).abs().max() / want.abs().max()
    assert err < out_rtol, f"output relative error {err:.2e}"
    if keep is not None:
        keep.update(drawn=drawn, out=out)
    return flagged.float().mean().item()


# ----------------------------------------------------------------------------- interpreter tests


@pytest.mark.parametrize("tiling", ["prop", "flash"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 4, 64), (8, 2, 128)], ids=["G1-D64", "G4-D128"])
def test_counts_and_output_match_reference(tiling, hq, hkv, d):
    q, k, v = _problem(1, hq=hq, hkv=hkv, d=d)
    lens = torch.tensor([700, 300])  # both end mid-tile; row 1 has fewer tiles than the cache
    s = torch.tensor([37, 5]) if tiling == "prop" else torch.tensor([600, 3])
    # float32 accumulation of at most S rows: relative error ~1e-6; 1e-5 leaves margin.
    flagged = _check_draws(q, k, v, s, _offsets(1, 2, hq, 700, 256), lens, tiling=tiling, tile=256,
                           out_rtol=1e-5)
    assert flagged < 0.01


@pytest.mark.parametrize("tiling", ["prop", "flash"])
def test_odd_tile_and_head_dim(tiling):
    """Tile and head_dim that are not powers of two (padded inside the kernel), 3 heads per group."""
    q, k, v = _problem(2, b=1, hq=6, hkv=2, tk=301, d=48)
    lens = torch.tensor([301])
    _check_draws(q, k, v, torch.tensor([50]), _offsets(2, 1, 6, 301, 96), lens, tiling=tiling, tile=96,
                 out_rtol=1e-5)


@pytest.mark.parametrize("tiling", ["prop", "flash"])
def test_hundreds_of_samples_on_one_key(tiling):
    """A peaked row puts > 256 samples on one key: flash feeds the counts to V in several base-256
    digits, prop resolves the samples to keys in many steps."""
    q, k, v = _problem(3, b=1, hq=2, hkv=1, tk=40, d=32, sharp=1.0)
    k[0, 0, 7] = q[0, 0]  # score |q|²/√d ≈ 5.7 above the rest: key 7 dominates head 0
    lens = torch.tensor([40])
    s = torch.tensor([1000])  # the reference puts 810 (prop) / 294 (flash) of them on key 7
    drawn = tk.decode_samples(q, k, s, tiling=tiling, tile=16, scale=32 ** -0.5,
                              tile_uniforms=_offsets(3, 1, 2, 40, 16), cache_len=lens)
    assert drawn.counts.max() > 256
    _check_draws(q, k, v, s, _offsets(3, 1, 2, 40, 16), lens, tiling=tiling, tile=16, out_rtol=1e-5)


def test_prop_gather_far_negative_peaked_scores():
    """Scores all near -60 (exp(s) alone underflows float32: the gather must weigh keys relative to each
    tile's max), peaked (most chunks of a tile carry ~0 weight), a tile of 100 keys (its last 32-key
    chunk is partial and the padding chunk empty) and caches ending mid-chunk: the chunk-first gather
    (score-pass chunk statistics, one chunk of scores per sample) draws what the reference draws."""
    q, k, v = _problem(12, b=2, hq=4, hkv=2, tk=530, d=32, sharp=4.0)
    q[..., 0] = 1.0
    k[..., 0] = -60.0 * 32 ** 0.5  # adds -60 to every scaled score
    lens = torch.tensor([530, 261])
    s = torch.tensor([64, 17])
    u = _offsets(12, 2, 4, 530, 100)
    drawn = tk.decode_samples(q, k, s, tiling="prop", tile=100, scale=32 ** -0.5, tile_uniforms=u, cache_len=lens)
    scores = torch.einsum("bhd,bhnd->bhn", q.double(), k.double().repeat_interleave(2, 1)) * 32 ** -0.5
    assert scores[..., :261].max() < -40  # far below exp's float32 range
    assert (drawn.counts.sum(-1) == s[:, None]).all()
    _check_draws(q, k, v, s, u, lens, tiling="prop", tile=100, out_rtol=1e-5)


def test_single_key_and_one_sample():
    q, k, v = _problem(4, b=2, hq=4, hkv=1, tk=33, d=16)
    lens = torch.tensor([1, 33])
    u = _offsets(4, 2, 4, 33, 16)
    for tiling in ("prop", "flash"):
        out = tk.santa_decode_forward(q, k, v, torch.tensor([1, 1]), tiling=tiling, tile=16, estimator="sys",
                                      scale=0.25, uniforms=u, cache_len=lens)
        # One valid key: every estimator returns V_0 exactly.
        assert torch.allclose(out[0], v[0, 0, 0].expand(4, 16), rtol=0, atol=1e-6)
        _check_draws(q, k, v, torch.tensor([1, 1]), u, lens, tiling=tiling, tile=16, out_rtol=1e-5)


def _force_flash_chunk_lookup(monkeypatch) -> None:
    """flash's chunk-first lookup on these tiny caches (by default it starts at FLASH_CHUNK_TILES tiles)."""
    monkeypatch.setattr(tk, "FLASH_CHUNK_TILES", 1)


@pytest.mark.parametrize("tiling, chunked", [("prop", False), ("flash", False), ("flash", True)],
                         ids=["prop", "flash-whole-tile", "flash-chunk-first"])
def test_nan_poisoned_buffers_and_padding(tiling, chunked, monkeypatch):
    """Every buffer the wrapper allocates starts as NaN / garbage, the cache padding is NaN: same result."""
    if chunked:
        _force_flash_chunk_lookup(monkeypatch)
    q, k, v = _problem(5, tk=520)
    lens = torch.tensor([520, 257])
    s, u = torch.tensor([20, 9]), _offsets(5, 2, 8, 520, 128)
    kw = dict(tiling=tiling, tile=128, estimator="sys", scale=0.125, uniforms=u, cache_len=lens)
    clean = tk.santa_decode_forward(q, k, v, s, **kw)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 257:] = float("nan")
    v2[1, :, 257:] = float("nan")

    def poisoned(shape, dtype, device):
        if dtype.is_floating_point:
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        return torch.full(shape, -123456, dtype=dtype, device=device)

    monkeypatch.setattr(tk, "_alloc", poisoned)
    out = tk.santa_decode_forward(q, k2, v2, s, **kw)
    assert not torch.isnan(out).any()
    assert torch.allclose(out, clean, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tiling", ["prop", "flash"])
def test_strided_inputs_and_counter_reset(tiling):
    """A [B, Tk, Hkv, D] cache layout, a stride-0 batch and stride-0 S / lengths give the same result;
    the launch counters are back to zero afterwards, so a second call repeats it exactly."""
    q, k, v = _problem(6, b=1, hq=8, hkv=2, tk=300)
    u = _offsets(6, 3, 8, 300, 128)
    lens = torch.tensor([300, 300, 300])
    dense = dict(tiling=tiling, tile=128, estimator="sys", scale=0.125, uniforms=u)
    kb, vb, qb = k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1), q.expand(3, -1, -1)
    base = tk.santa_decode_forward(qb.contiguous(), kb.contiguous(), vb.contiguous(), torch.tensor([40] * 3),
                                   cache_len=lens, **dense)
    k_t = kb.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # token-major storage
    v_t = vb.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    s0 = torch.tensor([40]).expand(3)
    l0 = torch.tensor([300]).expand(3)
    for kk, vv in ((kb, vb), (k_t, v_t)):
        out = tk.santa_decode_forward(qb, kk, vv, s0, cache_len=l0, **dense)
        assert torch.allclose(out, base, rtol=1e-6, atol=1e-6)
    assert all(int(buf.abs().sum()) == 0 for buf in _triton_support._COUNTERS.values())
    again = tk.santa_decode_forward(qb, kb, vb, s0, cache_len=l0, **dense)
    assert torch.allclose(again, base, rtol=1e-6, atol=1e-6)


def test_flash_chunk_first_lookup_draws_the_same_samples(monkeypatch):
    """flash's chunk-first lookup (chosen on long caches) draws what the reference draws: a partial
    last tile ending mid-chunk, 100 samples over 4 tiles (25 per tile: several lookup steps)."""
    _force_flash_chunk_lookup(monkeypatch)
    q, k, v = _problem(8, b=1, hq=8, hkv=2, tk=450, d=32)
    lens = torch.tensor([450])
    _check_draws(q, k, v, torch.tensor([100]), _offsets(8, 1, 8, 450, 128), lens, tiling="flash", tile=128,
                 out_rtol=1e-5)


@pytest.mark.parametrize("lookup", ["whole-tile", "chunk-first", "merge-steps"])
def test_flash_ragged_batch_rows(lookup, monkeypatch):
    """Rows of one batch with different cache lengths (tiles past a row's end write no partial; the
    merge reads only that row's tiles) and an odd last tile, through both sample lookups; with
    ``merge-steps`` the merge loads its 22 partials in several pipelined steps (as on caches of more
    than MERGE_CHUNK tiles)."""
    if lookup == "chunk-first":
        _force_flash_chunk_lookup(monkeypatch)
    if lookup == "merge-steps":
        monkeypatch.setattr(triton_flash, "MERGE_CHUNK", 8)
    q, k, v = _problem(9, b=2, hq=4, hkv=2, tk=700, d=32)
    lens = torch.tensor([700, 333])
    _check_draws(q, k, v, torch.tensor([64, 48]), _offsets(9, 2, 4, 700, 32), lens, tiling="flash", tile=32,
                 out_rtol=1e-5)


def test_flash_chunked_lookup_from_the_tile_count():
    """The stream kernel's chunk-first lookup is chosen from the cache allocation's tile count alone (a
    host int: no sync); both lookups draw the reference's samples (the tests above)."""
    geo = lambda tk_: tk.Geometry.of(torch.zeros(1, 8, 64), torch.zeros(1, 2, tk_, 64), 256)  # noqa: E731
    assert tk.FLASH_CHUNK_TILES == 128
    assert not tk._flash_chunked(geo(127 * 256)) and tk._flash_chunked(geo(127 * 256 + 1))


@pytest.mark.parametrize("tiling, chunked", [("prop", False), ("flash", False), ("flash", True)],
                         ids=["prop", "flash-whole-tile", "flash-chunk-first"])
def test_preallocated_cache_reads_nothing_past_cache_len(tiling, chunked, monkeypatch):
    """The CUDA-graph call: k / v hold Tk keys, cache_len < Tk (row 0 ends mid-tile and mid-chunk, row 1
    on a tile boundary, row 2 one key into its last tile), K / V past cache_len are NaN, and the
    per-tile uniforms cover all ceil(Tk / tile) tiles, the extra ones with values too. The reference's
    contract (``reference.decode_samples``): keys past cache_len are not in the row and uniforms of
    tiles past it are ignored, their budgets 0. So each row draws and returns exactly what the call on
    ``k[:, :, :cache_len]`` with ``uniforms[..., :ceil(cache_len / tile)]`` does, the reference agrees,
    and other values in the extra tiles' uniforms change nothing."""
    if chunked:
        _force_flash_chunk_lookup(monkeypatch)
    tile = 64
    q, k, v = _problem(13, b=3, hq=4, hkv=2, tk=448, d=32)  # 7 tiles
    lens = torch.tensor([300, 128, 257])
    s = torch.tensor([40, 9, 17]) if tiling == "prop" else torch.tensor([100, 9, 33])
    u = _offsets(13, 3, 4, 448, tile)
    for row, n in enumerate(lens.tolist()):
        k[row, :, n:] = float("nan")
        v[row, :, n:] = float("nan")
    kw = dict(tiling=tiling, tile=tile, scale=32 ** -0.5)
    long: dict = {}
    _check_draws(q, k, v, s, u, lens, tiling=tiling, tile=tile, out_rtol=1e-5, keep=long)  # vs the reference
    drawn, out = long["drawn"], long["out"]
    for row, n in enumerate(lens.tolist()):
        t_b, one = -(-n // tile), slice(row, row + 1)
        want = tk.decode_samples(q[one], k[one, :, :n], s[one], tile_uniforms=u[one, :, :t_b], cache_len=lens[one],
                                 **kw)
        assert torch.equal(drawn.counts[one, :, :n], want.counts) and not drawn.counts[row, :, n:].any()
        assert torch.equal(drawn.tile_budgets[one, :, :t_b], want.tile_budgets)
        assert not drawn.tile_budgets[row, :, t_b:].any()
        want_out = tk.santa_decode_forward(q[one], k[one, :, :n], v[one, :, :n], s[one], estimator="sys",
                                           uniforms=u[one, :, :t_b], cache_len=lens[one], **kw)
        # The same samples; float32 partial sums may group differently (merge steps, tiles per program).
        torch.testing.assert_close(out[one], want_out, rtol=1e-6, atol=1e-6)
    u_other = u.clone()
    for row, n in enumerate(lens.tolist()):
        u_other[row, :, -(-n // tile):] = 1.0 - u[row, :, -(-n // tile):] / 2
    again = tk.santa_decode_forward(q, k, v, s, estimator="sys", uniforms=u_other, cache_len=lens, **kw)
    assert torch.equal(again, out)


def test_unsupported_calls_use_the_reference():
    q, k, v = _problem(7, b=1, hq=4, hkv=2, tk=50, d=16)
    lens, s = torch.tensor([50]), torch.tensor([8])
    u = _offsets(7, 1, 4, 50, 16)
    q64, k64, v64 = q.double(), k.double(), v.double()
    kw = dict(tile=16, estimator="sys", scale=0.25, uniforms=u, cache_len=lens)
    assert not tk.supported(q64, k64, v64, tiling="prop", tile=16, estimator="sys")
    got = tk.santa_decode_forward(q64, k64, v64, s, tiling="prop", **kw)
    assert torch.equal(got, reference.santa_decode_forward(q64, k64, v64, s, tiling="prop", **kw))
    u_none = torch.rand(1, 4, 1, dtype=F64)
    kw_none = dict(kw, uniforms=u_none)
    got = tk.santa_decode_forward(q, k, v, s, tiling="none", **kw_none)
    assert torch.equal(got, reference.santa_decode_forward(q, k, v, s, tiling="none", **kw_none))


# ----------------------------------------------------------------------------- GPU tests


def _gpu_problem(seed, *, b, hq, hkv, tk, d, dtype, sharp=2.5):
    return _problem(seed, b=b, hq=hq, hkv=hkv, tk=tk, d=d, sharp=sharp, dtype=dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("tiling", "s_val"), [("prop", 128), ("prop", 256), ("flash", 1024), ("flash", 2048)],
                         ids=["prop-S128", "prop-S256", "flash-S1024", "flash-S2048"])
@pytest.mark.parametrize(("hq", "hkv", "d", "tkeys"), [(32, 8, 128, 32768), (8, 8, 64, 8191)],
                         ids=["H32-G4-D128-T32768", "H8-G1-D64-T8191"])
def test_gpu_counts_and_output(dtype, tiling, s_val, hq, hkv, d, tkeys):
    q, k, v = _gpu_problem(10, b=2, hq=hq, hkv=hkv, tk=tkeys, d=d, dtype=dtype)
    lens = torch.tensor([tkeys, tkeys // 2 + 77], device="cuda")
    s = torch.tensor([s_val, s_val // 2 + 1], device="cuda")
    # The output is rounded to bf16 / fp16 once: relative error <= 2^-8 of the largest entry.
    flagged = _check_draws(q, k, v, s, _offsets(10, 2, hq, tkeys, 256, "cuda"), lens, tiling=tiling,
                           tile=256, out_rtol=1e-2)
    assert flagged < 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", ["prop", "flash"])
def test_gpu_api_dispatches_to_kernels_and_poisoning(tiling, monkeypatch):
    from runtime_kernels.santa import santa_decode_attention

    q, k, v = _gpu_problem(11, b=3, hq=32, hkv=8, tk=8192 + 5, d=128, dtype=torch.bfloat16)
    u = _offsets(11, 3, 32, 8192 + 5, 256, "cuda")
    api_out = santa_decode_attention(q, k, v, 256, tiling=tiling, tile_uniforms=u)
    direct = tk.santa_decode_forward(q, k, v, torch.full((3,), 256, device="cuda"), tiling=tiling, tile=256,
                                     estimator="sys", scale=128 ** -0.5, uniforms=u,
                                     cache_len=torch.full((3,), 8197, device="cuda"))
    assert torch.allclose(api_out.float(), direct.float(), rtol=1e-2, atol=1e-3)  # prop: atomic order
    monkeypatch.setattr(tk, "_alloc", lambda shape, dtype, device: torch.full(
        shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device))
    poisoned = santa_decode_attention(q, k, v, 256, tiling=tiling, tile_uniforms=u)
    assert not torch.isnan(poisoned).any()
    assert torch.allclose(poisoned.float(), direct.float(), rtol=1e-2, atol=1e-3)


def _prop_expectation(q, k, v, budgets, num_samples, scale, cache_len, tile):
    """Σ_t (S_t/S) μ_t in float64 for given budgets [B,Hq,T] (App. P), μ_t the tile's attention mean."""
    u, _, _ = _tile_weights(q, k, scale, cache_len, tile)
    b, hq, t_all, _ = u.shape
    hkv, tkeys = k.shape[1], k.shape[2]
    ell = u.sum(-1).clamp_min(torch.finfo(F64).tiny)
    w = u * (budgets.to(F64) / num_samples.to(F64)[:, None, None] / ell)[..., None]
    w = w.reshape(b, hkv, hq // hkv, -1)[..., :tkeys]
    return torch.einsum("bkgn,bknd->bkgd", w, v.to(F64)).reshape(b, hq, -1)


@pytest.mark.gpu
@pytest.mark.parametrize(("tiling", "s_val"), [("prop", 128), ("flash", 256)], ids=["prop-S128", "flash-S256"])
def test_gpu_mean_converges_to_expectation(tiling, s_val):
    """2000 independent draws (a stride-0 batch, fresh offsets per row): the sample mean lies within a
    Bonferroni z-bound of the exact expectation (dense attention for flash, Σ_t (S_t/S) μ_t for prop)."""
    draws, hq, hkv, d, tkeys, tile = 2000, 8, 2, 128, 8191, 256
    q1, k1, v1 = _gpu_problem(12, b=1, hq=hq, hkv=hkv, tk=tkeys, d=d, dtype=torch.bfloat16, sharp=2.0)
    q, k, v = q1.expand(draws, -1, -1), k1.expand(draws, -1, -1, -1), v1.expand(draws, -1, -1, -1)
    u = torch.rand(draws, hq, -(-tkeys // tile), generator=torch.Generator("cuda").manual_seed(0),
                   dtype=F64, device="cuda")
    s = torch.full((draws,), s_val, device="cuda")
    lens = torch.full((draws,), tkeys, device="cuda")
    scale = d ** -0.5
    out = tk.santa_decode_forward(q, k, v, s, tiling=tiling, tile=tile, estimator="sys", scale=scale,
                                  uniforms=u, cache_len=lens).to(F64)
    if tiling == "flash":
        expect = reference.exact_attention(q1, k1, v1, scale=scale)[0]
    else:
        budgets = tk.decode_samples(q1, k1, s[:1], tiling="prop", tile=tile, scale=scale,
                                    tile_uniforms=u[:1], cache_len=lens[:1]).tile_budgets
        expect = _prop_expectation(q1, k1, v1, budgets, s[:1], scale, lens[:1], tile)[0]
    mean, sd = out.mean(0), out.std(0)
    n = mean.numel()
    # Bonferroni over the n = Hq·D outputs at family-wise level 1e-3, two-sided normal quantile.
    z = math.sqrt(2.0) * torch.special.erfinv(torch.tensor(1 - 1e-3 / n, dtype=F64)).item()
    statistical = z * sd / math.sqrt(draws)
    rounding = 2.0 ** -8 * out.abs().mean(0)  # each draw is rounded to bf16 once (<= 2^-8 relative)
    bound = statistical + rounding + 1e-5 * expect.abs().max()  # + float32 score error
    excess = ((mean - expect).abs() - bound).max()
    assert excess <= 0, f"sample mean off by {excess:.3e} beyond the bound"
    # The bound is the sampling error, not the rounding allowance, and the estimator does vary.
    assert rounding.median() < 0.5 * statistical.median() and sd.median() > 0


@pytest.mark.gpu
def test_gpu_prop_programmatic_dependent_launch_draws_the_same(monkeypatch):
    """prop's score -> budgets -> gather chained by programmatic dependent launch (the default on sm_90+)
    draws exactly the counts and output of plain launches, eager and replayed from a CUDA graph."""
    q, k, v = _gpu_problem(14, b=2, hq=32, hkv=8, tk=32768 + 5, d=128, dtype=torch.bfloat16)
    lens = torch.tensor([32768 + 5, 9000], device="cuda")
    s = torch.tensor([128, 77], device="cuda")
    u = _offsets(14, 2, 32, 32768 + 5, 256, "cuda")
    kw = dict(tiling="prop", tile=256, scale=128 ** -0.5, tile_uniforms=u, cache_len=lens)
    fwd = lambda: tk.santa_decode_forward(q, k, v, s, tiling="prop", tile=256, estimator="sys",  # noqa: E731
                                          scale=128 ** -0.5, uniforms=u, cache_len=lens)
    assert tk._pdl(q.device) == _triton_support.pdl_available(q.device)  # on wherever the device has it
    with monkeypatch.context() as plain:
        plain.setattr(tk, "_pdl", lambda device: False)
        plain_out, plain_counts = fwd(), tk.decode_samples(q, k, s, **kw).counts
    assert torch.equal(tk.decode_samples(q, k, s, **kw).counts, plain_counts)
    # float32 atomics add tile sums in arrival order: the output may differ in the last bits
    torch.testing.assert_close(fwd(), plain_out, rtol=1e-2, atol=1e-3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fwd()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, plain_out, rtol=1e-2, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize(("tiling", "s_val"), [("prop", 128), ("flash", 2048)], ids=["prop-S128", "flash-S2048"])
def test_gpu_graph_replay_follows_cache_len(tiling, s_val):
    """Captured once on a preallocated cache of 40000 keys (157 tiles: flash's chunk-first lookup), then
    replayed after writing new ``cache_len`` values (mid-tile, one key into a tile, the whole cache) and
    NaN past them into the same tensors: each replay returns what an eager call on those inputs returns."""
    t_alloc, tile = 40000, 256
    q, k, v = _gpu_problem(15, b=2, hq=32, hkv=8, tk=t_alloc, d=128, dtype=torch.bfloat16)
    k_clean, v_clean = k.clone(), v.clone()
    u = _offsets(15, 2, 32, t_alloc, tile, "cuda")
    s = torch.tensor([s_val, s_val // 2 + 1], device="cuda")
    lens = torch.tensor([1000, 333], device="cuda")
    fwd = lambda: tk.santa_decode_forward(q, k, v, s, tiling=tiling, tile=tile, estimator="sys",  # noqa: E731
                                          scale=128 ** -0.5, uniforms=u, cache_len=lens)
    fwd()  # compiles the kernels and allocates the arrival counters before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fwd()
    for new_lens in ([1000, 333], [32768 + 5, 257], [t_alloc, 9000]):
        lens.copy_(torch.tensor(new_lens))
        k.copy_(k_clean)
        v.copy_(v_clean)
        for row, n in enumerate(new_lens):
            k[row, :, n:] = float("nan")
            v[row, :, n:] = float("nan")
        graph.replay()
        eager = fwd()
        torch.cuda.synchronize()
        assert torch.isfinite(captured).all()
        torch.testing.assert_close(captured, eager, rtol=1e-2, atol=1e-3)  # prop: float32 atomics' order


def test_programmatic_dependent_launch_is_off_without_a_compiled_gpu():
    """The interpreter and CPU tensors never get ``launch_pdl`` (the interpreter has no such option)."""
    assert not _triton_support.pdl_available(torch.device("cpu"))
    if _triton_support.interpreting() and torch.cuda.is_available():
        assert not _triton_support.pdl_available(torch.device("cuda"))
