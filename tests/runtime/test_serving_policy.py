"""The never-slower policy's bookkeeping: groups, the cost cache, length buckets (no GPU needed)."""

from __future__ import annotations

import json

import pytest
import torch

from runtime_kernels import serving_policy as sp


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CALIB_RUNTIME_CACHE", str(tmp_path))
    sp.forget_all()
    yield
    sp.forget_all()


class _Runtime:
    """Layers 0 and 3 never win (None); 1 and 2 share a signature, 4 has its own."""

    def cost_signature(self, layer: int) -> str | None:
        return {1: "a", 2: "a", 4: "b"}.get(layer)


def test_groups_are_timed_once_and_the_slower_group_runs_dense():
    timed, prepared = [], []

    def time_layer(layer: int) -> tuple[float, float]:
        timed.append(layer)
        return (1.0, 2.0) if layer == 1 else (3.0, 2.0)  # group a wins, group b loses

    dense = sp.choose_dense_layers(_Runtime(), 5, "B1|T256", torch.device("cpu"), prepared.append, time_layer)
    assert dense == frozenset({0, 3, 4}) and timed == [1, 4] and prepared == [{1, 2, 4}]
    # a second choice at the same shape reads the records: nothing timed, only the winners prepared
    dense = sp.choose_dense_layers(_Runtime(), 5, "B1|T256", torch.device("cpu"), prepared.append,
                                   lambda layer: pytest.fail("timed again"))
    assert dense == frozenset({0, 3, 4}) and prepared[-1] == {1, 2}
    # another shape is measured anew; a tie is not a win
    dense = sp.choose_dense_layers(_Runtime(), 5, "B8|T256", torch.device("cpu"), prepared.append, lambda layer: (2.0, 2.0))
    assert dense == frozenset(range(5))


def test_unmeasurable_groups_run_the_method_and_record_nothing(tmp_path):
    dense = sp.choose_dense_layers(_Runtime(), 5, "B1|T256", torch.device("cpu"), lambda layers: None, lambda layer: None)
    assert dense == frozenset({0, 3})
    assert not (tmp_path / "costs.json").exists()


def test_a_runtime_without_signatures_runs_everywhere():
    prepared = []
    assert sp.choose_dense_layers(object(), 3, "B1", torch.device("cpu"), prepared.append, lambda layer: (9.0, 1.0)) == frozenset()
    assert prepared == [{0, 1, 2}]


def test_costs_persist_across_processes_and_bad_records_are_ignored(tmp_path):
    sp.record("k1", 1.5, 2.5)
    on_disk = json.loads((tmp_path / "costs.json").read_text())
    assert on_disk == {"k1": [1.5, 2.5]}
    on_disk.update({"bad": "x", "short": [1.0], "k2": [3.0, 1.0]})
    (tmp_path / "costs.json").write_text(json.dumps(on_disk))
    sp._LOADED = False  # a new process: the file is read once
    sp._MEMORY.clear()
    assert sp.measured("k1") == [1.5, 2.5] and sp.measured("k2") == [3.0, 1.0]
    assert sp.measured("bad") is None and sp.measured("short") is None


def test_a_corrupt_cost_file_is_an_empty_cache(tmp_path):
    (tmp_path / "costs.json").write_text("{not json")
    sp._LOADED = False
    assert sp.measured("k") is None
    sp.record("k", 1.0, 2.0)  # and it is replaced by a valid one
    assert json.loads((tmp_path / "costs.json").read_text()) == {"k": [1.0, 2.0]}


@pytest.mark.parametrize("n, bucket", [(1, 1), (100, 104), (4096, 4096), (4097, 4608), (5000, 5120), (8000, 8192),
                                       (8192, 8192), (8193, 9216)])
def test_length_buckets_are_eight_steps_per_power_of_two(n, bucket):
    assert sp.length_bucket(n) == bucket
    assert sp.length_bucket(n) >= n


def test_prefill_without_a_gpu_always_runs_the_method():
    calls = []
    chooser = sp.PrefillChooser()
    q = torch.zeros(1, 2, 8, 4)
    out = chooser.run("sig", q, q, lambda: calls.append("m") or q, lambda: calls.append("d") or q)
    assert out is q and calls == ["m"]


def _timeable(monkeypatch) -> None:
    """Costs measurable on the CPU (the timings themselves are stubbed by each test)."""
    monkeypatch.setattr(sp, "can_time", lambda device: True)


def test_prefill_choice_takes_the_median_of_several_timings_and_is_remembered(monkeypatch):
    """A GPU-shaped call (timings stubbed): the method's median 5 ms against dense's 3 ms loses, so the
    first call returns dense's output, records both medians, and the next call of that shape asks the
    caller for dense (None) without timing or running the method again."""
    from types import SimpleNamespace

    _timeable(monkeypatch)

    readings = iter([5.0, 1.0, 9.0, 3.0, 3.0, 3.0])  # method x3, then dense x3
    monkeypatch.setattr(sp, "_event_ms", lambda fn: (next(readings), fn()))
    q = SimpleNamespace(shape=(1, 2, 100, 4), device=torch.device("cpu"))
    calls = []
    chooser = sp.PrefillChooser()
    out = chooser.run("sig", q, q, lambda: calls.append("m") or "method-out", lambda: calls.append("d") or "dense-out")
    assert out == "dense-out" and calls == ["m", "d"] + ["m"] * 3 + ["d"] * 3  # warm-ups, then the timed calls
    key = next(k for k in sp._MEMORY if k.startswith("prefill|") and "|sig|" in k)
    assert sp.measured(key) == [5.0, 3.0] and "B1|T104|Tk104" in key
    calls.clear()
    assert chooser.run("sig", q, q, lambda: calls.append("m"), lambda: calls.append("d")) is None and calls == []


def test_a_decided_prefill_shape_is_answered_from_the_chooser_and_counted(monkeypatch):
    """After the first call decides, calls of the same (signature, B, length buckets) neither consult the
    shared cache nor time anything; a length in another bucket is a new decision. The counters say how
    many calls each path served."""
    from types import SimpleNamespace

    _timeable(monkeypatch)

    readings = iter([1.0, 1.0, 1.0, 2.0, 2.0, 2.0])  # the method wins: 1 ms against 2 ms
    monkeypatch.setattr(sp, "_event_ms", lambda fn: (next(readings), fn()))
    q = SimpleNamespace(shape=(2, 2, 100, 4), device=torch.device("cpu"))
    chooser = sp.PrefillChooser()
    assert chooser.run("win", q, q, lambda: "m", lambda: "d") == "m"
    asked = []
    monkeypatch.setattr(sp, "measured", lambda key: asked.append(key))
    longer = SimpleNamespace(shape=(2, 2, 103, 4), device=torch.device("cpu"))  # same bucket, 104
    assert [chooser.run("win", x, x, lambda: "m", lambda: "d") for x in (q, longer)] == ["m", "m"] and asked == []
    other = SimpleNamespace(shape=(2, 2, 105, 4), device=torch.device("cpu"))  # bucket 112
    monkeypatch.setattr(sp, "_event_ms", lambda fn: (3.0 if fn() == "m" else 2.0, fn()))
    assert chooser.run("win", other, other, lambda: "m", lambda: "d") == "d" and len(asked) == 1
    assert (chooser.method_calls, chooser.dense_calls) == (3, 1)
    chooser.reset_counts()
    assert (chooser.method_calls, chooser.dense_calls) == (0, 0)


def test_a_method_that_declines_a_shape_is_not_asked_again(monkeypatch):
    """``None`` from the method's warm-up (a dense layer, a dense bucket) settles the shape as dense: no
    timing, and later calls skip the method."""
    from types import SimpleNamespace

    _timeable(monkeypatch)

    monkeypatch.setattr(sp, "_event_ms", lambda fn: pytest.fail("nothing to time"))
    q = SimpleNamespace(shape=(1, 2, 64, 4), device=torch.device("cpu"))
    calls = []
    chooser = sp.PrefillChooser()
    for _ in range(3):
        assert chooser.run("declines", q, q, lambda: calls.append("m"), lambda: calls.append("d")) is None
    assert calls == ["m"] and chooser.dense_calls == 3


def _scripted_wall(monkeypatch, times):
    """``_wall_ms`` that runs its function and reports the next of ``times``."""
    readings = iter(times)
    monkeypatch.setattr(sp, "_wall_ms", lambda fn: (next(readings), fn()))


def test_the_guard_keeps_dense_when_the_whole_prefill_is_faster_without_the_method(monkeypatch):
    """First meeting: an untimed run with the method, then method / dense alternated twice; dense's best
    (9) beats the method's (10), so the last run, dense, is what the caller keeps; the next prefill of
    the shape runs dense at once, and so does a new guard (the costs are on disk)."""
    _scripted_wall(monkeypatch, [12.0, 9.5, 10.0, 9.0])
    calls = []
    guard = sp.PrefillGuard()
    out = guard.run("prefill-model|k", lambda on: calls.append(on) or ("m" if on else f"d{len(calls)}"))
    assert calls == [True, True, False, True, False] and out == "d5"
    assert sp.measured("prefill-model|k") == [10.0, 9.0]
    calls.clear()
    assert guard.run("prefill-model|k", lambda on: calls.append(on) or on) is False and calls == [False]
    assert sp.PrefillGuard().run("prefill-model|k", lambda on: on) is False


def test_the_guard_ends_on_the_method_when_it_wins(monkeypatch):
    _scripted_wall(monkeypatch, [8.0, 9.0, 7.0, 9.5])
    calls = []
    out = sp.PrefillGuard().run("prefill-model|win", lambda on: calls.append(on) or ("m" if on else "d"))
    assert calls == [True, True, False, True, False, True] and out == "m"  # one more run: the chosen path last
    assert sp.measured("prefill-model|win") == [7.0, 9.0]


def test_the_guard_keeps_the_method_off_path_untimed_when_every_layer_chose_dense(monkeypatch):
    """The first run's layers all served dense (the chooser counted no method call): that run's cache is
    the method-off path's, nothing is timed or written to disk, and later prefills run with the method off.
    A layer that ran the method leads to the timed comparison instead."""
    monkeypatch.setattr(sp, "_wall_ms", lambda fn: pytest.fail("nothing to time"))
    chooser = sp.PrefillChooser()
    chooser.method_calls = 5  # an earlier prefill's count: not this run's
    calls = []

    def prefill(on: bool) -> str:
        calls.append(on)
        chooser.dense_calls += 1
        return "all dense" if on else "off"

    guard = sp.PrefillGuard()
    assert guard.run("prefill-model|dense", prefill, chooser) == "all dense" and calls == [True]
    assert guard.run("prefill-model|dense", prefill, chooser) == "off" and calls == [True, False]
    assert sp.measured("prefill-model|dense") is None
    _scripted_wall(monkeypatch, [8.0, 9.0, 7.0, 9.5])

    def one_layer_runs_it(on: bool) -> str:
        chooser.method_calls += on
        return "m" if on else "d"

    assert sp.PrefillGuard().run("prefill-model|mixed", one_layer_runs_it, chooser) == "m"
    assert sp.measured("prefill-model|mixed") == [7.0, 9.0]


def test_the_guard_does_not_repeat_a_long_prefill(monkeypatch):
    """A prefill as long as the limit is device-bound: recorded as not compared (equal times), the
    method's layers stand, nothing run with the method off."""
    _scripted_wall(monkeypatch, [sp.PREFILL_GUARD_MS])
    calls = []
    out = sp.PrefillGuard().run("prefill-model|long", lambda on: calls.append(on) or "m")
    assert calls == [True, True] and out == "m"
    assert sp.measured("prefill-model|long") == [sp.PREFILL_GUARD_MS, sp.PREFILL_GUARD_MS]
    monkeypatch.setattr(sp, "_wall_ms", lambda fn: pytest.fail("decided: nothing to time"))
    assert sp.PrefillGuard().run("prefill-model|long", lambda on: on) is True


def test_a_measured_shape_is_answered_from_memory_until_a_cost_changes(monkeypatch):
    """Once every group of a shape is measured, the next choice is a lookup: the records are not read
    again (the static loop asks at every new view); ``cost_signatures()`` is preferred to asking per
    layer; a new record or ``forget_all`` drops the remembered answers."""

    class Many(_Runtime):
        asked = 0

        def cost_signatures(self):
            Many.asked += 1
            return tuple(self.cost_signature(layer) for layer in range(5))

    rt, prepared = Many(), []
    first = sp.choose_dense_layers(rt, 5, "B1|T256", torch.device("cpu"), prepared.append,
                                   lambda layer: (1.0, 2.0) if layer == 1 else (3.0, 2.0))
    second = sp.choose_dense_layers(rt, 5, "B1|T256", torch.device("cpu"), prepared.append,
                                    lambda layer: pytest.fail("timed again"))
    monkeypatch.setattr(sp, "measured", lambda key: pytest.fail("records read again"))
    third = sp.choose_dense_layers(rt, 5, "B1|T256", torch.device("cpu"), prepared.append,
                                   lambda layer: pytest.fail("timed again"))
    assert first == second == third == frozenset({0, 3, 4}) and Many.asked == 3
    assert prepared == [{1, 2, 4}, {1, 2}, {1, 2}]
    monkeypatch.undo()
    sp.record(f"decode|{sp.device_key(torch.device('cpu'))}|b|B1|T256", 1.0, 2.0)  # group b now wins
    assert sp.choose_dense_layers(rt, 5, "B1|T256", torch.device("cpu"), prepared.append,
                                  lambda layer: pytest.fail("timed again")) == frozenset({0, 3})
    sp.forget_all()
    timed = []
    sp.choose_dense_layers(rt, 5, "B1|T256", torch.device("cpu"), prepared.append,
                           lambda layer: timed.append(layer) or (3.0, 2.0))
    assert timed == [1, 4]
