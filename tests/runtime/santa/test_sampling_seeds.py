"""SamplingSeeds.generators: which generator a prefill call of some batch rows draws from."""

from __future__ import annotations

import pytest
import torch

from runtime_kernels.santa.draws import SamplingSeeds


def _first_draws(gens: list[torch.Generator]) -> list[float]:
    return [torch.rand((), generator=g).item() for g in gens]


def _fresh(seeds: list[int]) -> list[float]:
    return _first_draws([torch.Generator().manual_seed(s) for s in seeds])


@pytest.mark.parametrize("rows, seeds", [(slice(1, 3), [12, 13]), ([2, 0], [13, 11]), (None, [11, 12, 13])])
def test_a_call_of_some_rows_draws_from_those_rows_seeds(rows, seeds):
    """Per-row seeds 11, 12, 13: a call covering rows 1-2 (a slice), rows 2 and 0 (a ragged run of rows that
    are not adjacent, in its call order) or the whole batch draws from the generators of those seeds."""
    got = SamplingSeeds([11, 12, 13]).generators(torch.device("cpu"), len(seeds), rows=rows)
    assert _first_draws(got) == _fresh(seeds)


def test_rows_that_do_not_cover_the_call_are_refused():
    with pytest.raises(ValueError, match="rows \\[2, 0\\] of them do not cover a call of 3 rows"):
        SamplingSeeds([11, 12, 13]).generators(torch.device("cpu"), 3, rows=[2, 0])
