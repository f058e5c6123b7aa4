"""The autotuner's selection logic with injected timings (no GPU)."""

from __future__ import annotations

import math

import pytest

from cudnn_fuse import autotune
from cudnn_fuse.autotune import Candidate, Config, SkipCandidate, select
from cudnn_fuse.errors import UnsupportedError


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def fake(first: dict, median: dict, clock=None, cost=0.0, calls=None):
    """Timing functions reading per-index tables; a value that is an exception is raised."""

    def run_once(c):
        if calls is not None:
            calls.append(("once", c.index))
        if clock is not None:
            clock.t += cost
        v = first[c.index]
        if isinstance(v, BaseException):
            raise v
        return v

    def time_candidate(c):
        if calls is not None:
            calls.append(("time", c.index))
        if clock is not None:
            clock.t += cost
        v = median[c.index]
        if isinstance(v, BaseException):
            raise v
        return v

    return run_once, time_candidate


def cands(n, **kw):
    return [Candidate(index=i, name=f"eng{i}", **kw) for i in range(n)]


def test_picks_the_fastest_median_not_the_fastest_first_run():
    run_once, time_c = fake({0: 1.0, 1: 1.1, 2: 1.2}, {0: 1.0, 1: 0.8, 2: 0.95})
    winner, timings = select(cands(3), run_once, time_c, Config())
    assert winner.index == 1
    assert [t.status for t in timings] == ["timed"] * 3
    assert winner.median_ms == 0.8


def test_prunes_candidates_over_twice_the_best_first_run():
    calls = []
    run_once, time_c = fake({0: 1.0, 1: 2.5, 2: 120.0, 3: 1.5}, {0: 1.0, 1: 0.1, 2: 0.1, 3: 1.4}, calls=calls)
    winner, timings = select(cands(4), run_once, time_c, Config())
    status = {t.index: t.status for t in timings}
    assert status == {0: "timed", 1: "pruned", 2: "pruned", 3: "timed"}
    assert ("time", 1) not in calls and ("time", 2) not in calls  # never timed in full
    assert winner.index == 0


def test_a_later_fast_first_run_prunes_earlier_survivors():
    run_once, time_c = fake({0: 5.0, 1: 1.0}, {0: 0.5, 1: 1.0})
    winner, timings = select(cands(2), run_once, time_c, Config())
    assert timings[0].status == "pruned"
    assert winner.index == 1


def test_failures_score_inf_and_do_not_raise():
    run_once, time_c = fake({0: RuntimeError("launch failed"), 1: 2.0, 2: 2.1},
                            {1: ValueError("bad"), 2: 2.0})
    winner, timings = select(cands(3), run_once, time_c, Config())
    assert timings[0].status.startswith("failed:RuntimeError")
    assert math.isinf(timings[0].first_ms)
    assert timings[1].status.startswith("failed:ValueError") and math.isinf(timings[1].median_ms)
    assert winner.index == 2


def test_nan_timing_counts_as_failure():
    run_once, time_c = fake({0: float("nan"), 1: 3.0}, {1: 3.0})
    winner, timings = select(cands(2), run_once, time_c, Config())
    assert timings[0].status == "failed" and winner.index == 1


def test_all_failing_raises_unsupported():
    run_once, time_c = fake({0: RuntimeError("x"), 1: RuntimeError("y")}, {})
    with pytest.raises(UnsupportedError, match="no candidate ran"):
        select(cands(2), run_once, time_c, Config())


def test_budget_stops_starting_new_candidates():
    clock = FakeClock()
    calls = []
    run_once, time_c = fake({i: 1.0 for i in range(10)}, {i: 1.0 - i / 100 for i in range(10)}, clock, cost=1.0,
                            calls=calls)
    winner, timings = select(cands(10), run_once, time_c, Config(budget_s=3.5), clock=clock)
    started = {i for kind, i in calls if kind == "once"}
    assert started == {0, 1, 2, 3}  # 4 s of first runs, then the budget is spent
    assert all(t.status == "budget" for t in timings if t.index not in started)
    # the budget is spent before any full timing: the best single run wins
    assert winner.index in started


def test_budget_leaves_time_for_full_timing_when_it_can():
    clock = FakeClock()
    run_once, time_c = fake({0: 1.0, 1: 1.0}, {0: 0.9, 1: 0.7}, clock, cost=1.0)
    winner, timings = select(cands(2), run_once, time_c, Config(budget_s=100), clock=clock)
    assert winner.index == 1 and winner.status == "timed"


def test_workspace_cap_skips_candidates_known_up_front_and_at_build():
    cs = cands(3)
    cs[0].workspace = 10 << 20

    def run_once(c):
        if c.index == 1:
            raise SkipCandidate("workspace 2 > cap 1")
        return 1.0

    winner, timings = select(cs, run_once, lambda c: 1.0, Config(workspace_cap=1 << 20))
    assert timings[0].status.startswith("skipped:workspace")
    assert timings[1].status == "skipped:workspace 2 > cap 1"
    assert winner.index == 2


def test_determinism_filter():
    cs = cands(3)
    cs[0].deterministic = False
    run_once, time_c = fake({0: 0.5, 1: 1.0, 2: 1.1}, {0: 0.4, 1: 1.0, 2: 0.9})
    winner, timings = select(cs, run_once, time_c, Config(), deterministic=True)
    assert timings[0].status == "skipped:nondeterministic"
    assert winner.index == 2
    winner, _ = select(cs, run_once, time_c, Config(), deterministic=False)
    assert winner.index == 0


def test_every_candidate_timing_is_recorded_as_json():
    run_once, time_c = fake({0: 1.0, 1: 9.0}, {0: 1.0})
    _, timings = select(cands(2), run_once, time_c, Config())
    rows = [t.to_dict() for t in timings]
    assert rows[0]["median_ms"] == 1.0 and rows[1]["median_ms"] is None and rows[1]["first_ms"] == 9.0
    assert {"index", "name", "engine_id", "knobs", "workspace", "status"} <= set(rows[0])


def test_set_autotune_and_env(monkeypatch):
    monkeypatch.setattr(autotune, "_enabled", None)
    monkeypatch.setenv("CUDNN_FUSE_AUTOTUNE", "1")
    assert autotune.autotune_enabled()
    monkeypatch.setenv("CUDNN_FUSE_AUTOTUNE", "0")
    assert not autotune.autotune_enabled()
    autotune.set_autotune(True)
    assert autotune.autotune_enabled()
    autotune.set_autotune(False)
    monkeypatch.setenv("CUDNN_FUSE_AUTOTUNE", "1")
    assert not autotune.autotune_enabled()  # the explicit call wins over the environment


def test_knobs_round_trip_through_json():
    import cudnn

    knobs = {cudnn.knob_type.KERNEL_CFG: 4, cudnn.knob_type.MMA_TILE_M: 2}
    as_json = autotune.knobs_to_json(knobs)
    assert as_json == {"KERNEL_CFG": 4, "MMA_TILE_M": 2}
    assert autotune.knobs_from_json(as_json) == knobs


def test_the_fastest_candidate_wins_whatever_its_compilation():
    """A runtime-compiled winner is kept (no preference for precompiled engines); the notes are
    recorded in the timings."""
    cands = [Candidate(0, runtime_compiled=True), Candidate(1, runtime_compiled=None),
             Candidate(2, runtime_compiled=False), Candidate(3, runtime_compiled=False)]
    first = {0: 1.0, 1: 1.005, 2: 1.02, 3: 1.1}
    winner, timings = select(cands, *fake(first, dict(first)), Config(budget_s=1e9))
    assert winner.index == 0
    assert [t.runtime_compiled for t in timings] == [True, None, False, False]


# ---------------------------------------------------------------- device_ms's spin (fake GPU)


class FakeSpin:
    """Stands in for autotune._behind_spin: each call answers the next (enqueue_ms, spin_ms[, kernel_ms])
    (the calls queued evenly over enqueue_ms; on the GPU back to back after the spin, kernel_ms each,
    0 by default), times every call as the attempt's number, and records the spin it was asked for."""

    def __init__(self, answers):
        self.answers, self.asked = list(answers), []

    def __call__(self, call, iters, spin_us, before=None):
        self.asked.append(spin_us)
        enqueue_ms, spin_ms, *kernel_ms = self.answers.pop(0)
        if callable(enqueue_ms):  # the queued times themselves (ms since the clock started)
            queued = [enqueue_ms(i) for i in range(iters)]
        else:
            queued = [enqueue_ms * (i + 1) / iters for i in range(iters)]
        starts = [i * (kernel_ms[0] if kernel_ms else 0.0) for i in range(iters)]  # back to back after the spin
        return [float(len(self.asked))] * iters, queued, starts, spin_ms


@pytest.fixture
def spin(monkeypatch):
    monkeypatch.setattr(autotune, "_host_us_seen", 0.0)

    def install(answers):
        fake_spin = FakeSpin(answers)
        monkeypatch.setattr(autotune, "_behind_spin", fake_spin)
        return fake_spin
    return install


def test_device_ms_keeps_timings_queued_behind_the_spin(spin):
    s = spin([(2.0, 3.2)])  # 30 calls queued in 2 ms behind a 3.2 ms spin
    assert autotune.device_ms(lambda: None, 30) == [1.0] * 30
    assert s.asked == [200 + 100 * 30]


def test_device_ms_drops_the_calls_queued_after_the_spin_ended(spin):
    s = spin([(4.0, 3.2)])  # 30 calls in 4 ms behind a 3.2 ms spin: the last 7 (3.33 ms on) may time the host
    out = autotune.device_ms(lambda: None, 30)
    assert out == [1.0] * 23 and len(s.asked) == 1


def test_device_ms_measures_again_when_the_host_outran_the_spin(spin):
    # 30 calls took 9 ms to queue (300 us each) behind a 3.2 ms spin: most of them timed the host
    s = spin([(9.0, 3.2), (9.1, 40.0)])
    assert autotune.device_ms(lambda: None, 30) == [2.0] * 30  # the second measurement's times
    assert len(s.asked) == 2
    assert s.asked[1] >= 200 + 4 * 300 * 30  # sized from the measured 300 us a call, with a margin


def test_device_ms_remembers_a_slow_hosts_rate_for_the_next_spin(spin):
    spin([(9.0, 3.2), (9.1, 40.0)])
    autotune.device_ms(lambda: None, 30)
    s = spin([(9.0, 14.0)])
    autotune.device_ms(lambda: None, 30)
    assert s.asked[0] == pytest.approx(200 + 1.5 * (9.1e3 / 30) * 30)  # started long enough: no second attempt
    assert len(s.asked) == 1


def test_device_ms_seeds_the_next_spin_from_the_latest_rate_not_the_highest(spin):
    spin([(9.0, 3.2), (9.1, 40.0)])  # a slow moment: 300 us a call
    autotune.device_ms(lambda: None, 30)
    spin([(1.5, 14.0)])  # the host back at 50 us a call
    autotune.device_ms(lambda: None, 30)
    assert autotune._host_us_seen == pytest.approx(1.5 * 50.0)
    s = spin([(1.5, 14.0)])
    autotune.device_ms(lambda: None, 30, host_us_per_call=10.0)
    assert s.asked == [pytest.approx(200 + 1.5 * 50.0 * 30)]  # from the latest rate, not 450 us a call


def test_device_ms_seeds_from_the_median_interval_not_one_slow_call(spin):
    # 30 calls at 50 us each, but call 10 waited 20 ms (a collection, a first kernel load): the mean
    # reads 716 us a call, the median 50 us
    s = spin([(lambda i: 0.05 * (i + 1) + (20.0 if i >= 10 else 0.0), 30.0)])
    out = autotune.device_ms(lambda: None, 30)
    assert len(out) == 30 and len(s.asked) == 1  # every call was queued before the GPU reached it
    assert autotune._host_us_seen == pytest.approx(1.5 * 50.0)


def test_a_one_call_timing_leaves_the_seed_alone(spin):
    spin([(1.5, 14.0)])
    autotune.device_ms(lambda: None, 30)
    spin([(0.9, 1.0)])  # one call, its interval the spin's launch and a 900 us hiccup
    autotune.device_ms(lambda: None, 1)
    assert autotune._host_us_seen == pytest.approx(1.5 * 50.0)


def test_device_ms_gives_up_after_its_attempts_and_logs(spin, caplog):
    s = spin([(10.0, 1.0)] * autotune.SPIN_ATTEMPTS)
    with caplog.at_level("INFO", logger="cudnn_fuse.autotune"):
        out = autotune.device_ms(lambda: None, 5)
    assert out == [float(autotune.SPIN_ATTEMPTS)] * 5  # nothing was queued in time: the last attempt's times
    assert len(s.asked) == autotune.SPIN_ATTEMPTS and s.asked == sorted(s.asked) and s.asked[0] < s.asked[-1]
    assert "include launch overhead" in caplog.text


def test_spin_stats_count_timings_respins_and_spin_time(spin, monkeypatch):
    monkeypatch.setattr(autotune, "_SPIN", {"timings": 0, "respins": 0, "spin_ms": 0.0})
    spin([(2.0, 3.2), (9.0, 3.2), (9.1, 40.0)])  # one clean timing, then one measured again
    autotune.device_ms(lambda: None, 30)
    autotune.device_ms(lambda: None, 30)
    got = autotune.spin_stats()
    assert (got["tune_timings"], got["tune_respins"]) == (2, 1)
    assert got["tune_spin_ms"] == pytest.approx(3.2 + 3.2 + 40.0)
    assert got["tune_host_us_seen"] == pytest.approx(1.5 * 9.1e3 / 30, abs=0.01)
    import cudnn_fuse as cf

    assert {k: v for k, v in cf.plan_stats().items() if k.startswith("tune_")} == got


def test_device_ms_caps_the_remembered_rate(spin):
    spin([(50.0, 60.0)])  # a callable that takes 10 ms of host time a call
    autotune.device_ms(lambda: None, 5)
    assert autotune._host_us_seen == autotune.HOST_US_CAP


def test_spin_timed_without_remember_leaves_the_seed_alone(spin):
    spin([(9.0, 3.2), (9.1, 40.0)])
    assert autotune.spin_timed(lambda i: None, 30, 100.0, remember=False) == [2.0] * 30
    assert autotune._host_us_seen == 0.0


def test_benchsuite_device_times_goes_through_the_checked_spin(spin, monkeypatch):
    from cudnn_fuse import benchsuite

    s = spin([(4.0, 3.2)])
    out = benchsuite.device_times(lambda *a: None, [()], 30, host_us=50.0)
    assert out == [1.0] * 23  # the calls queued after the spin ended are dropped
    assert s.asked == [500 + 1.5 * 50 * 30]


def test_device_ms_keeps_late_queued_calls_the_gpu_had_not_reached(spin):
    # 30 long kernels (0.5 ms each) queued over 4 ms behind a 3.2 ms spin: the GPU was still busy with
    # earlier calls when the last ones were queued, so none of them waited on the host
    s = spin([(4.0, 3.2, 0.5)])
    assert autotune.device_ms(lambda: None, 30) == [1.0] * 30 and len(s.asked) == 1


def test_spin_timed_with_no_calls_measures_nothing(spin):
    s = spin([])
    assert autotune.device_ms(lambda: None, 0) == [] and s.asked == []


# ---------------------------------------------------------------- heat before timing


def test_heat_runs_the_fastest_first_candidate_once_before_any_timing():
    calls = []
    run_once, time_c = fake({0: 1.2, 1: 0.9, 2: 1.0}, {0: 1.1, 1: 0.95, 2: 0.9}, calls=calls)

    def heat(c, seconds):
        calls.append(("heat", c.index, seconds))

    winner, _ = select(cands(3), run_once, time_c, Config(budget_s=10, heat_s=0.5, heat_min_ms=0.25), heat=heat)
    heats = [i for i, call in enumerate(calls) if call[0] == "heat"]
    assert [calls[i] for i in heats] == [("heat", 1, 0.5)]  # candidate 1 had the best first run
    first_time = next(i for i, call in enumerate(calls) if call[0] == "time")
    last_once = max(i for i, call in enumerate(calls) if call[0] == "once")
    assert last_once < heats[0] < first_time
    assert winner.index == 2  # the heat does not change how the medians decide


@pytest.mark.parametrize("cfg", [Config(heat_s=0.5, heat_min_ms=2.0), Config(heat_s=0.0, heat_min_ms=0.25)])
def test_no_heat_for_short_graphs_or_when_turned_off(cfg):
    seen = []
    run_once, time_c = fake({0: 1.0, 1: 1.1}, {0: 1.0, 1: 0.9})
    select(cands(2), run_once, time_c, cfg, heat=lambda c, s: seen.append(c.index))
    assert seen == []


def test_heat_takes_at_most_a_quarter_of_the_budget_and_counts_against_it():
    clock = FakeClock()
    run_once, time_c = fake({0: 1.0, 1: 1.0}, {0: 0.9, 1: 0.7}, clock, cost=0.1)
    got = []

    def heat(c, seconds):
        got.append(seconds)
        clock.t += 5.0  # a heat that overran: the budget is then spent

    winner, timings = select(cands(2), run_once, time_c, Config(budget_s=2.0, heat_s=1.0, heat_min_ms=0.5),
                             clock=clock, heat=heat)
    assert got == [0.5]
    assert [t.status for t in timings] == ["budget", "budget"]
    assert winner.median_ms == winner.first_ms  # no full timing: the best first run stands


def test_no_heat_once_the_first_runs_spent_the_budget():
    clock = FakeClock()
    seen = []
    run_once, time_c = fake({0: 1.0, 1: 1.0}, {0: 0.9, 1: 0.7}, clock, cost=0.9)  # 1.8 s of first runs
    select(cands(2), run_once, time_c, Config(budget_s=2.0, heat_s=0.5, heat_min_ms=0.5), clock=clock,
           heat=lambda c, s: seen.append(s))
    assert seen == []  # 1.8 + 0.5 s would pass the 2 s budget: the heat would only leave no timing


def test_a_failing_heat_is_logged_and_timing_goes_on(caplog):
    run_once, time_c = fake({0: 1.0, 1: 1.0}, {0: 0.9, 1: 0.7})

    def heat(c, seconds):
        raise RuntimeError("no GPU")

    with caplog.at_level("DEBUG", logger="cudnn_fuse.autotune"):
        winner, timings = select(cands(2), run_once, time_c, Config(heat_s=0.5, heat_min_ms=0.5), heat=heat)
    assert winner.index == 1 and all(t.status == "timed" for t in timings)
    assert "heating the GPU failed" in caplog.text


def test_heat_gpu_runs_until_the_time_is_up_syncing_every_four_calls():
    clock = FakeClock()
    log = []

    def run():
        log.append("run")
        clock.t += 0.1

    n = autotune.heat_gpu(run, 1.0, clock=clock, sync=lambda: log.append("sync"))
    assert n == 12  # 1.0 s reached after the 10th call; it stops at the next sync
    assert log.count("sync") == 3 and log[4] == "sync" and log[-1] == "sync"
