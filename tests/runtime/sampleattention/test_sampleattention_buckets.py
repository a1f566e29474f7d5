"""Length-bucket table: boundaries, the one-time log beyond the tuned range, artifact round trip."""

from __future__ import annotations

import json
import logging

import pytest

from runtime_kernels.sampleattention.buckets import BucketRow, BucketTable

LLAMA_EDGES = [16384, 49152, 81920, 114688]  # the paper's <16K, [16K,48K), [48K,80K), [80K,112K), >=112K


def llama_table(max_length: int | None = 131072) -> BucketTable:
    rows = [BucketRow(0.98, 0.90, 1), BucketRow(0.95, 0.95, 1), BucketRow(0.95, 0.90, 1),
            BucketRow(0.90, 0.90, 2), BucketRow(0.92, 0.85, 2)]
    return BucketTable(LLAMA_EDGES, rows, blk=64, max_length=max_length)


@pytest.mark.parametrize("length,bucket", [
    (1, 0), (16383, 0), (16384, 1), (16385, 1), (49151, 1), (49152, 2), (81919, 2), (81920, 3),
    (114687, 3), (114688, 4), (131072, 4), (10**6, 4),
])
def test_lookup_at_boundaries(length: int, bucket: int) -> None:
    table = llama_table()
    assert table.bucket_index(length) == bucket
    assert table.lookup(length) is table.rows[bucket]


def test_beyond_last_bucket_uses_last_row_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    table = llama_table(max_length=131072)
    with caplog.at_level(logging.WARNING, logger="runtime_kernels.sampleattention.buckets"):
        assert table.lookup(131072) is table.rows[-1]
        assert not caplog.records  # the longest tuned length itself is inside the table
        assert table.lookup(131073) is table.rows[-1]
        assert table.lookup(500000) is table.rows[-1]
    assert len(caplog.records) == 1
    assert "131073" in caplog.records[0].getMessage() and "131072" in caplog.records[0].getMessage()


def test_unbounded_table_never_logs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        llama_table(max_length=None).lookup(10**7)
    assert not caplog.records


def test_round_trip_through_json() -> None:
    table = llama_table()
    data = json.loads(json.dumps(table.to_dict()))
    assert data["edges"] == LLAMA_EDGES and data["blk"] == 64 and len(data["rows"]) == 5
    assert BucketTable.from_dict(data) == table


def test_single_bucket_table() -> None:
    table = BucketTable([], [BucketRow(0.9, 0.9, 1)])
    assert table.lookup(1) == table.lookup(10**6) == BucketRow(0.9, 0.9, 1)


@pytest.mark.parametrize("edges,rows,match", [
    ([100, 100], 3, "strictly increasing"),
    ([200, 100], 3, "strictly increasing"),
    ([0, 100], 3, "positive"),
    ([100, 200], 2, "need 3 rows"),
])
def test_bad_tables_are_refused(edges: list[int], rows: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BucketTable(edges, [BucketRow(0.9, 0.9, 1)] * rows)


@pytest.mark.parametrize("kwargs,match", [
    ({"alpha_c": 0.0, "alpha_s": 0.9, "chunk_n": 1}, "alpha_c"),
    ({"alpha_c": 0.9, "alpha_s": 1.2, "chunk_n": 1}, "alpha_s"),
    ({"alpha_c": 0.9, "alpha_s": 0.9, "chunk_n": 0}, "chunk_n"),
])
def test_bad_rows_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BucketRow(**kwargs)


def test_from_dict_names_what_is_missing() -> None:
    with pytest.raises(ValueError, match="edges"):
        BucketTable.from_dict({"rows": []})
    with pytest.raises(ValueError, match="alpha_c, alpha_s, chunk_n"):
        BucketTable.from_dict({"edges": [], "rows": [{"alpha_c": 0.9}]})
