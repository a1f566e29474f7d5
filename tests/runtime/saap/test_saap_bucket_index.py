"""BucketIndex: build at prefill, incremental append during decode (must equal build on the whole cache)."""

from __future__ import annotations

import pytest
import torch

from runtime_kernels.saap.bucket_index import BucketIndex, nearest_centroid, searchable_range


def _data(b=2, hkv=3, t=200, d=8, c=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, hkv, t, d, generator=g), torch.randn(hkv, c, d, generator=g)


def _brute_bucket(keys: torch.Tensor, cents: torch.Tensor) -> torch.Tensor:
    """float64 argmin ||k - c||² per (b, h, t): [B, Hkv, T]."""
    d2 = ((keys.double().unsqueeze(-2) - cents.double()[None, :, None]) ** 2).sum(-1)  # [B, Hkv, T, C]
    return d2.argmin(-1)


def _lists(offsets: torch.Tensor, indices: torch.Tensor) -> dict:
    b, h, c1 = offsets.shape
    return {(i, j, c): indices[i, j, offsets[i, j, c]:offsets[i, j, c + 1]].tolist()
            for i in range(b) for j in range(h) for c in range(c1 - 1)}


@pytest.mark.parametrize("sink,recent", [(1, 20), (0, 5), (4, 1), (1, 0)], ids=lambda v: str(v))
def test_build_matches_brute_force(sink, recent):
    keys, cents = _data()
    idx = BucketIndex.build(keys, cents, sink=sink, recent=recent)
    brute = _brute_bucket(keys, cents)
    kb = idx.key_bucket.long()
    assert (kb[..., :sink] == -1).all()
    assert torch.equal(kb[..., sink:], brute[..., sink:])
    lo, hi = searchable_range(keys.shape[2], sink, recent)
    offsets, indices = idx.csr()
    assert indices.shape[-1] == hi - lo
    for (i, j, c), pos in _lists(offsets, indices).items():
        expect = [p for p in range(lo, hi) if brute[i, j, p] == c]
        assert pos == expect  # exactly the candidates of bucket c, ascending


def test_no_slack_build_is_packed_csr():
    keys, cents = _data()
    idx = BucketIndex.build(keys, cents, sink=1, recent=10, slack=0.0, min_slack=0)
    offsets, indices = idx.csr()
    assert torch.equal(idx.slot_start, offsets)
    assert torch.equal(idx.slots[..., : indices.shape[-1]], indices)


@pytest.mark.parametrize("t0,step", [(150, 1), (100, 3), (30, 1), (1, 1), (0, 1), (0, 40), (60, 50), (10, 170)],
                         ids=["T0150-step1", "T0100-step3", "T030-step1", "T01-step1", "T00-step1", "T00-step40",
                              "T060-step50", "T010-chunk170"])
@pytest.mark.parametrize("slack,min_slack", [(0.25, 4), (0.0, 0)], ids=["slack", "noslack"])
def test_append_equals_build(t0, step, slack, min_slack):
    keys, cents = _data(t=180)
    sink, recent = 1, 16
    full = BucketIndex.build(keys, cents, sink=sink, recent=recent)
    inc = BucketIndex.build(keys[:, :, :t0], cents, sink=sink, recent=recent, slack=slack, min_slack=min_slack)
    for n_step, start in enumerate(range(t0, keys.shape[2], step)):
        inc.append(keys[:, :, start:start + step])
        if n_step % 5 and inc.length < keys.shape[2]:
            continue  # compare every 5th step and at the end
        ref = BucketIndex.build(keys[:, :, : inc.length], cents, sink=sink, recent=recent)
        assert torch.equal(inc.key_bucket, ref.key_bucket)
        o1, i1 = inc.csr()
        o2, i2 = ref.csr()
        assert torch.equal(o1, o2) and torch.equal(i1, i2)
    assert inc.length == full.length
    assert torch.equal(inc.csr()[1], full.csr()[1])


def test_append_amortizes_repacks():
    keys, cents = _data(b=1, hkv=2, t=1200, c=4)
    idx = BucketIndex.build(keys[:, :, :1000], cents, sink=1, recent=8)
    for t in range(1000, 1200):
        idx.append(keys[:, :, t:t + 1])
    # 25% slack on ~250-key buckets: 200 appends fit without a new layout
    assert idx.repacks == 1


def test_gather_buckets():
    keys, cents = _data()
    idx = BucketIndex.build(keys, cents, sink=1, recent=20)
    offsets, indices = idx.csr()
    buckets = torch.tensor([[[0, 3], [6, 1], [2, 2]], [[5, 4], [0, 6], [1, 0]]])
    pos, valid = idx.gather_buckets(buckets)
    for i in range(2):
        for j in range(3):
            for li in range(2):
                c = int(buckets[i, j, li])
                expect = indices[i, j, offsets[i, j, c]:offsets[i, j, c + 1]].tolist()
                assert pos[i, j, li][valid[i, j, li]].tolist() == expect


def test_nearest_centroid_broadcast_and_chunks():
    x = torch.randn(3, 500, 6)
    c = torch.randn(3, 9, 6)
    brute = ((x.double().unsqueeze(-2) - c.double().unsqueeze(1)) ** 2).sum(-1).argmin(-1)
    assert torch.equal(nearest_centroid(x, c, chunk=64), brute)


@pytest.mark.parametrize("t0,step", [(30, 1), (10, 170)], ids=["T030-step1", "T010-chunk170"])
def test_an_index_in_kept_storage_equals_build_and_keeps_its_addresses(t0, step):
    """Built into :meth:`BucketIndex.storage_for` and appended to (inserts and relayouts), the lists equal
    a fresh build's, in the same tensors throughout; a second index built into the storage (the next
    request) overwrites the first completely."""
    keys, cents = _data(t=180)
    storage = BucketIndex.storage_for(2, 3, 7, keys.shape[2], keys.device)
    ptrs = [x.data_ptr() for x in storage]
    kb = BucketIndex._assign(keys[:, :, :t0], cents, 0, 1)
    idx = BucketIndex.from_assignments(kb, cents, sink=1, recent=16, storage=storage)
    for start in range(t0, keys.shape[2], step):
        idx.append(keys[:, :, start:start + step])
        assert [x.data_ptr() for x in (idx.slot_start, idx.bucket_count, idx.slots)] == ptrs
    assert idx.repacks > 1  # the appends laid the lists out again, in place
    o_ref, i_ref = BucketIndex.build(keys, cents, sink=1, recent=16).csr()
    o, i = idx.csr()
    assert torch.equal(o, o_ref) and torch.equal(i, i_ref)
    other = keys.flip(2)[:, :, :90]
    again = BucketIndex.from_assignments(BucketIndex._assign(other, cents, 0, 1), cents, sink=1, recent=16,
                                         storage=storage)
    o_ref, i_ref = BucketIndex.build(other, cents, sink=1, recent=16).csr()
    assert torch.equal(again.csr()[0], o_ref) and torch.equal(again.csr()[1], i_ref)


def test_kept_storage_fits_the_worst_layout_and_refuses_a_larger_one():
    """Every candidate in one bucket is the largest layout of ``max_keys`` keys: it fits; storage for
    fewer keys refuses it in one line."""
    b, hkv, c, t, sink = 1, 2, 5, 300, 1
    kb = torch.full((b, hkv, t), 3, dtype=torch.int32)
    kb[..., :sink] = -1
    cents = torch.zeros(hkv, c, 4)
    idx = BucketIndex.from_assignments(kb, cents, sink=sink, recent=0,
                                       storage=BucketIndex.storage_for(b, hkv, c, t, kb.device))
    assert idx.bucket_count[..., 3].tolist() == [[t - sink] * hkv]
    with pytest.raises(ValueError, match="index storage holds .* slots, the layout needs"):
        BucketIndex.from_assignments(kb, cents, sink=sink, recent=0,
                                     storage=BucketIndex.storage_for(b, hkv, c, t // 2, kb.device))
    with pytest.raises(ValueError, match="does not fit B=1, Hkv=2, C=5"):
        BucketIndex.from_assignments(kb, cents, sink=sink, recent=0,
                                     storage=BucketIndex.storage_for(b, hkv, c + 1, t, kb.device))


def test_many_keys_at_once_go_to_their_buckets_ends_without_a_new_layout():
    """Room in every bucket: 20 keys per append (a static loop's view change brings a bucket of them) are
    written at their buckets' ends in one pass, no relayout, and the lists equal a build's."""
    keys, cents = _data(t=300)
    idx = BucketIndex.build(keys[:, :, :100], cents, sink=1, recent=16, slack=1.0, min_slack=128)
    for start in range(100, 300, 20):
        idx.append(keys[:, :, start:start + 20])
    assert idx.repacks == 1  # the build's layout only
    o_ref, i_ref = BucketIndex.build(keys, cents, sink=1, recent=16).csr()
    o, i = idx.csr()
    assert torch.equal(o, o_ref) and torch.equal(i, i_ref)


class _HostReads:
    """Counts a tensor's value read on the host (``bool``, ``int``, ``float``, ``item``): each is a GPU sync."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("__bool__", "__int__", "__float__", "item"):
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, **k):
                self.count += 1
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_kept_storage_builds_without_host_reads_and_absorbs_a_view_with_one(monkeypatch):
    """Building a request's index into kept storage reads nothing back (capacity settles from host sizes);
    absorbing a view's keys at once reads one flag (room in every bucket), not one per key."""
    keys, cents = _data(t=400)
    storage = BucketIndex.storage_for(2, 3, 7, keys.shape[2], keys.device)
    kb = BucketIndex._assign(keys[:, :, :200], cents, 0, 1)
    reads = _HostReads(monkeypatch)
    idx = BucketIndex.from_assignments(kb, cents, sink=1, recent=16, storage=storage)
    assert reads.count == 0
    idx.append(keys[:, :, 200:240])  # 40 keys: below the relayout threshold, inserted together
    assert reads.count == 1


@pytest.mark.parametrize("t,kept", [(180, True), (180, False), (12, True)], ids=["kept", "fresh", "no-candidates"])
def test_layers_indexed_together_equal_each_built_alone(t, kept, monkeypatch):
    """Three layers' assignments laid out in one batched pass: each layer's lists, counts, starts and key
    buckets equal its own :meth:`BucketIndex.from_assignments` (and a brute-force build), in that
    layer's kept storage (no host read) or fresh lists; appends continue each alone. T = 12 leaves no
    candidate beyond sink and window."""
    data = [_data(t=t, seed=s) for s in range(3)]
    kbs = torch.stack([BucketIndex._assign(k, c, 0, 1) for k, c in data])  # [L, B, Hkv, T]
    stores = [BucketIndex.storage_for(2, 3, 7, 400, kbs.device) if kept else None for _ in data]
    reads = _HostReads(monkeypatch)
    many = BucketIndex.from_assignments_many(kbs, [c for _, c in data], sink=1, recent=16, storages=stores)
    assert reads.count == (0 if kept else 3)  # fresh lists size themselves: one read per layer
    monkeypatch.undo()
    for layer, ((keys, cents), idx) in enumerate(zip(data, many)):
        alone = BucketIndex.build(keys, cents, sink=1, recent=16)
        assert torch.equal(idx.key_bucket, alone.key_bucket) and idx.searchable_hi == alone.searchable_hi
        assert torch.equal(idx.csr()[0], alone.csr()[0]) and torch.equal(idx.csr()[1], alone.csr()[1])
        assert torch.equal(idx.slot_start, alone.slot_start) and torch.equal(idx.bucket_count, alone.bucket_count)
        assert idx.fixed == kept and (not kept or idx.slots.data_ptr() == stores[layer][2].data_ptr())
    more = _data(t=t + 40, seed=7)[0][:, :, t:]
    many[1].append(more)
    full = BucketIndex.build(torch.cat([data[1][0], more], 2), data[1][1], sink=1, recent=16)
    assert torch.equal(many[1].csr()[1], full.csr()[1]) and torch.equal(many[0].csr()[1], BucketIndex.build(
        *data[0], sink=1, recent=16).csr()[1])  # layer 0 untouched by layer 1's append


def test_layers_indexed_together_need_one_bucket_count():
    kbs = torch.zeros(2, 1, 1, 30, dtype=torch.int32)
    with pytest.raises(ValueError, match="the same number of buckets"):
        BucketIndex.from_assignments_many(kbs, [torch.zeros(1, 5, 4), torch.zeros(1, 6, 4)], sink=1, recent=4,
                                          storages=[None, None])
    with pytest.raises(ValueError, match="2 layers of assignments, 1 centroids"):
        BucketIndex.from_assignments_many(kbs, [torch.zeros(1, 5, 4)], sink=1, recent=4, storages=[None, None])
