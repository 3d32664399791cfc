"""The SLO planner (flagscale/planner/): its decisions on recorded metric series (table tests), the predictor,
the capacity fit, the histogram percentile, hysteresis and delays, and the `slo` block's validation."""

import math

import pytest

from flagscale.planner import forecast
from flagscale.planner.capacity import CapacityCurve
from flagscale.planner.forecast import Trend
from flagscale.planner.histogram import bucket_delta, merge, percentile
from flagscale.planner.planner import Planner
from flagscale.planner.types import DECODE, PREFILL, Observation, PlannerSettings, Slo, planned_awake
from tests.unit.test_config import base, error_of

SLO = Slo(ttft_ms=500, itl_ms=50)


def settings(**overrides):
    values = dict(slo=SLO, min_replicas=1, max_replicas=8, upscale_delay_s=10, downscale_delay_s=60, start_s=20)
    return PlannerSettings(**(values | overrides))


def replica_latency(load, floor, saturation):
    """The latency a replica of the given saturation throughput shows at `load` tokens/s (queueing shape)."""
    return floor / (1 - min(load / saturation, 0.99))


def replay(planner, series, replicas=1):
    """Feed a recorded series (time, prompt tok/s, extra observation fields) through the planner as the cluster
    would: a replica asked for serves `start_s` later, one let go stops at once. Returns the decisions."""
    decisions, asked, starting = [], replicas, []
    for time_s, prompt_tps, extra in series:
        replicas = min(asked, replicas + sum(1 for ready in starting if ready <= time_s))
        starting = [ready for ready in starting if ready > time_s]
        ttft = replica_latency(prompt_tps / max(replicas, 1), 100, 1000) if replicas else None
        fields = dict(ttft_ms=ttft, itl_ms=20.0, prompt_tps=prompt_tps, output_tps=prompt_tps / 4)
        fields |= dict(arrival_rps=prompt_tps / 500) | extra
        decision = planner.decide(Observation(time_s, replicas, **fields))
        decisions.append(decision)
        starting += [time_s + planner.settings.start_s] * max(0, decision.target - replicas - len(starting))
        asked = decision.target
        replicas = min(replicas, asked)
    return decisions


def test_percentile_interpolates_inside_the_bucket_and_merges_replicas():
    one = {0.1: 10, 0.5: 90, 1.0: 100, math.inf: 100}
    assert percentile(one, 50) == pytest.approx(0.1 + 0.4 * 40 / 80)
    assert percentile(one, 100) == 1.0
    assert percentile({0.1: 0, math.inf: 0}, 90) is None
    assert percentile({0.1: 0, 1.0: 0, math.inf: 5}, 90) == 1.0  # past the last bound: that bound
    window = bucket_delta({0.1: 15, math.inf: 20}, {0.1: 10, math.inf: 10})
    assert window == {0.1: 5, math.inf: 10}
    assert bucket_delta({0.1: 1, math.inf: 1}, {0.1: 10, math.inf: 10}) == {0.1: 1, math.inf: 1}  # a restart
    assert merge([window, window]) == {0.1: 10, math.inf: 20}


def test_trend_forecasts_a_ramp_ahead_and_never_below_zero():
    trend = Trend()
    for t in range(0, 600, 5):
        trend.update(t, 2.0 * t)
    assert trend.forecast(60) == pytest.approx(2.0 * 595 + 120, rel=0.1)
    falling = Trend()
    for t in range(0, 600, 5):
        falling.update(t, max(0.0, 1000 - 2.0 * t))
    assert falling.forecast(600) == 0.0
    assert "in 60 s" in trend.describe(60, "req/s")


def test_capacity_fits_the_load_one_replica_sustains_within_the_bound():
    curve = CapacityCurve(bound_ms=500)
    curve.update(50, 100.0)  # light load: its floor, and no fit yet
    assert curve.sustainable() is None
    for load in (300, 500, 700, 800):
        curve.update(load, replica_latency(load, 100, 1000))
    assert curve.sustainable() == pytest.approx(800, rel=0.05)  # 1000 x (1 - 100 / 500)
    seeded = CapacityCurve(bound_ms=500, seed=640)
    assert seeded.sustainable() == 640
    slow = CapacityCurve(bound_ms=50)
    slow.update(10, 80)
    assert slow.unreachable()


def batching_latency(load):
    """A batching engine's time to first token (ms) at `load` tokens/s per replica: its floor alone, past it as soon
    as requests run together (a prompt waits for the running batch's step), then flat far beyond."""
    return 30.0 if load < 50 else 200.0 + load / 10


def test_capacity_keeps_what_a_replica_carried_within_the_bound_where_the_fit_reads_light_load_as_saturation():
    curve = CapacityCurve(bound_ms=500)
    curve.update(10, batching_latency(10))  # its floor
    curve.update(1600, batching_latency(1600))  # a spike, within the bound
    for _ in range(50):
        curve.update(300, batching_latency(300))  # the fall: a light load, 7x the floor
    assert curve.fitted < 400  # the queueing shape takes it for near saturation
    assert curve.sustainable() == 1600  # what it carried within the bound stands
    curve.update(1000, 800.0)  # over the bound below that: one window could be an outlier
    assert curve.sustainable() > 1500
    for _ in range(40):
        curve.update(1000, 800.0)  # window after window: the work got heavier
    assert curve.sustainable() < 1000
    seeded = CapacityCurve(bound_ms=500, seed=2000)  # auto_tune measured 2000 within the bound
    for _ in range(20):
        seeded.update(300, batching_latency(300))
    assert seeded.sustainable() == 2000
    fresh = CapacityCurve(bound_ms=500)
    fresh.update(40, 30.0)  # a light load within the bound is no estimate
    assert fresh.sustainable() is None


def test_one_window_over_the_bound_does_not_replace_a_seed():
    """As on one H200 on 2026-12-02 (docs/benchmarks.md): the first loaded window, in a spike the replicas could
    not carry (a light measured load, ITL far over the bound), set both figures to a tenth of the seed at once."""
    curve = CapacityCurve(bound_ms=50, seed=25715)
    curve.update(1000, 20.0)  # its floor
    curve.update(2700, 400.0)
    assert curve.sustainable() > 0.85 * 25715
    for _ in range(40):
        curve.update(2700, 400.0)
    assert curve.sustainable() < 0.15 * 25715  # what the windows say: 1,705


def test_a_pool_of_a_batching_engine_comes_down_when_the_load_falls():
    """As on two H200s on 2026-12-01 (docs/benchmarks.md): with the fit alone, a pool at 4 stays at 4 through a
    fall to a quarter of one replica's load, each window's estimate tracking the load it was made from."""
    planner = Planner(settings(max_replicas=4, upscale_delay_s=0, downscale_delay_s=30))
    replicas, decisions = 4, []
    for time_s in range(0, 300, 5):
        # a few requests (its floor), 1,600 a replica of 4, then a quarter of one replica's
        total = 100.0 if time_s < 20 else 6400.0 if time_s <= 60 else 400.0
        obs = Observation(
            time_s, replicas, ttft_ms=batching_latency(total / replicas), itl_ms=20.0, prompt_tps=total,
            arrival_rps=total / 500,
        )  # fmt: skip
        decisions.append(planner.decide(obs))
        replicas = decisions[-1].target
    assert decisions[12].target == 4  # held through the load
    assert decisions[-1].target == 1, [(d.time_s, d.target, d.reason) for d in decisions if d.changed]


def test_a_colocated_seed_is_in_the_unit_of_the_pools_load():
    planner = Planner(settings(seed_prompt_tps=1000.0, seed_output_tps=100.0, output_token_cost=4.0))
    assert {dim.name: dim.curve.sustainable() for dim in planner.dimensions} == {"ttft": 1400.0, "itl": 1400.0}


def test_a_pool_with_a_replica_asleep_looks_a_wake_ahead_and_a_cold_start_once_all_are_awake():
    planner = Planner(settings(min_replicas=0, start_s=120, wake_s=2, upscale_delay_s=5))
    busy = dict(ttft_ms=200.0, itl_ms=20.0, prompt_tps=500.0, arrival_rps=1.0)
    assert planner.decide(Observation(0, 2, asleep=1, **busy)).forecast["horizon_s"] == 7
    assert planner.decide(Observation(5, 2, asleep=0, **busy)).forecast["horizon_s"] == 125
    never = Planner(settings(start_s=120, upscale_delay_s=5))  # wake_s None: its replicas never sleep
    assert never.decide(Observation(0, 2, asleep=1, **busy)).forecast["horizon_s"] == 125


def test_a_pool_whose_replicas_sleep_is_idle_on_its_first_quiet_window():
    """Its replicas are a wake away; a pool that would start them again waits until the forecast says nothing
    comes (the forecast's level takes minutes to fall to nothing after the last request)."""
    wants = {}
    for name, wake_s in (("sleeps", 2.0), ("starts", None)):
        planner = Planner(settings(min_replicas=0, wake_s=wake_s, upscale_delay_s=0, downscale_delay_s=0))
        for time_s in range(0, 60, 5):
            busy = dict(ttft_ms=200.0, itl_ms=20.0, prompt_tps=500.0, arrival_rps=1.0, running=2)
            planner.decide(Observation(time_s, 2, **busy))
        wants[name] = planner.decide(Observation(60, 2)).desired
    assert wants["sleeps"] == 0 and wants["starts"] > 0, wants


def test_a_pool_whose_replicas_sleep_lets_them_go_after_the_sleep_delay_not_the_downscale_delay():
    """Letting a replica idle into sleep is undone by a wake, removing one by a start: after a burst, the pool
    that sleeps asks for fewer awake once the wish has lasted sleep_delay_s; the same pool without sleep holds
    its replicas for downscale_delay_s."""
    released, delays = {}, dict(upscale_delay_s=0, downscale_delay_s=300, seed_prompt_tps=1000, seed_output_tps=250)
    for name, planned in (
        ("sleeps", planned_awake(settings(**delays), sleep_delay_s=10)),
        ("starts", settings(**delays)),
    ):
        planner = Planner(planned)  # one replica sustains 1,000 prompt + 4 x 250 output tokens/s (the seed)
        busy = dict(ttft_ms=300.0, itl_ms=20.0, prompt_tps=3000.0, output_tps=750.0, arrival_rps=8.0, running=8)
        for time_s in range(0, 60, 2):
            planner.decide(Observation(time_s, 4, **busy))
        assert planner.target == 4, planner.last_reason
        quiet = dict(busy, prompt_tps=300.0, output_tps=75.0, arrival_rps=0.8, running=1)
        released[name] = next(t for t in range(60, 600, 2) if planner.decide(Observation(t, 4, **quiet)).target < 4)
    # the level falls for ~6 s before it wants 3 (the forecast's smoothing), then the delay runs
    assert 60 + 10 < released["sleeps"] < 60 + 30 and released["starts"] > 60 + 300, released


def test_a_pool_whose_replicas_sleep_follows_a_fall_sooner(monkeypatch):
    """Its replicas are a wake away: its load's level averages over WAKE_LEVEL_TAU_S, not LEVEL_TAU_S, so after a
    burst it wants fewer awake sooner than it would with the cold-start pool's average (and a replica is ready
    again in a wake if the fall was noise)."""
    delays = dict(upscale_delay_s=0, downscale_delay_s=300, seed_prompt_tps=1000, seed_output_tps=250)
    released = {}
    for name, tau in (("wake", forecast.WAKE_LEVEL_TAU_S), ("start", forecast.LEVEL_TAU_S)):
        monkeypatch.setattr(forecast, "WAKE_LEVEL_TAU_S", tau)
        planner = Planner(planned_awake(settings(**delays), sleep_delay_s=2))
        busy = dict(ttft_ms=300.0, itl_ms=20.0, prompt_tps=3000.0, output_tps=750.0, arrival_rps=8.0, running=8)
        for time_s in range(0, 60, 2):
            planner.decide(Observation(time_s, 4, **busy))
        quiet = dict(busy, prompt_tps=300.0, output_tps=75.0, arrival_rps=0.8, running=1)
        released[name] = next(t for t in range(60, 600, 2) if planner.decide(Observation(t, 4, **quiet)).target < 2)
    assert released["wake"] < released["start"] - 2, released


RAMP = [(t, 200 + 15 * t, {}) for t in range(0, 300, 5)]
FLAT = [(t, 600 + (40 if (t // 5) % 2 else -40), {}) for t in range(0, 900, 5)]


@pytest.mark.parametrize(
    "name, series, check",
    [
        # a ramp: the count follows it up, sized ahead: TTFT over its SLO in few windows
        ("ramp", RAMP, lambda ds: ds[-1].target >= 6 and sum(d.measured["ttft_ms"] > 500 for d in ds) <= 10),
        # load wobbling inside the band: no change after the first fit
        ("no flapping", FLAT, lambda ds: len({d.target for d in ds[20:]}) == 1),
        # idle from the start: down to min (1), never below it
        ("idle keeps min", [(t, 0, {"arrival_rps": 0}) for t in range(0, 300, 5)], lambda ds: ds[-1].target == 1),
    ],
)
def test_recorded_series(name, series, check):
    decisions = replay(Planner(settings()), series)
    assert check(decisions), [(d.time_s, d.target, d.reason) for d in decisions if d.changed]


def test_upscale_waits_upscale_delay_and_downscale_waits_downscale_delay():
    planner = Planner(settings(upscale_delay_s=20, downscale_delay_s=60))
    decisions = replay(planner, [(t, 200 + 20 * t, {}) for t in range(0, 100, 5)])
    first_wish = next(d for d in decisions if d.desired > d.current)
    first_change = next(d for d in decisions if d.changed)
    assert first_change.time_s - first_wish.time_s >= 20 and "if it lasts" in first_wish.reason
    quiet = replay(planner, [(t, 100, {}) for t in range(100, 300, 5)], replicas=planner.target)
    wish = next(d for d in quiet if d.desired < d.current)
    down = next(d for d in quiet if d.changed)
    assert down.time_s - wish.time_s >= 60


def test_never_outside_min_and_max():
    decisions = replay(
        Planner(settings(min_replicas=2, max_replicas=3)), [(t, 5000, {"queue": 10}) for t in range(0, 200, 5)]
    )
    assert {d.target for d in decisions} <= {2, 3} and decisions[-1].target == 3


def test_slo_broken_with_a_queue_adds_one_before_any_fit():
    planner = Planner(settings())
    obs = Observation(0, 1, ttft_ms=900, itl_ms=20, queue=6, prompt_tps=100, arrival_rps=1)
    decision = planner.decide(obs)
    assert decision.desired == 2 and "TTFT p90 900 ms > 500 ms, 6 queued" in decision.reason


def test_decode_pool_grows_on_a_full_kv_cache_and_a_prefill_pool_ignores_itl():
    planner = Planner(settings(role=DECODE))
    decision = planner.decide(Observation(0, 2, ttft_ms=90, itl_ms=20, kv_usage=0.95, output_tps=10, running=4))
    assert decision.desired == 3 and "KV cache 95%" in decision.reason
    prefill = Planner(settings(role=PREFILL))
    calm = prefill.decide(Observation(0, 2, ttft_ms=100, itl_ms=900, queue=3, kv_usage=0.99, running=2))
    assert calm.desired == 2  # a prefill pool is sized on TTFT alone


def test_zero_replicas_start_one_at_once_and_idle_goes_back_to_zero_after_the_delay():
    planner = Planner(settings(min_replicas=0, downscale_delay_s=30))
    assert planner.decide(Observation(0, 0)).target == 0
    woken = planner.decide(Observation(1, 0, held=1))
    assert woken.target == 1 and "1 request(s) held" in woken.reason  # no upscale delay from zero
    busy = planner.decide(Observation(2, 1, ttft_ms=100, running=1, arrival_rps=0.5, prompt_tps=10))
    assert busy.target == 1
    targets = [planner.decide(Observation(t, 1)).target for t in range(200, 260, 5)]
    assert targets[0] == 1 and targets[-1] == 0 and "idle" in planner.last_reason


def test_the_slo_block_is_validated_naming_the_key():
    def with_resources(resources):
        cfg = base()
        cfg["serve"][0]["resources"] = resources
        return error_of(cfg)

    bounds = {"min_replicas": 1, "max_replicas": 2}
    assert "ttft_ms" in with_resources(bounds | {"slo": {"ttft_ms": -5}})
    assert "unknown key 'ttft'" in with_resources(bounds | {"slo": {"ttft": 500}})
    message = with_resources({"slo": {"ttft_ms": 500}})
    assert "slo needs min_replicas and max_replicas" in message and "resources" in message
    assert "percentile" in with_resources(bounds | {"slo": {"ttft_ms": 500, "percentile": 100}})
    assert "slo needs ttft_ms, itl_ms or both" in with_resources(bounds | {"slo": {}})
    custom = base()
    custom["serve"][0] = {"serve_id": "c", "module": "m.py", "name": "C", "resources": bounds | {"slo": {"itl_ms": 9}}}
    assert "`resources.slo` is for engine nodes" in error_of(custom)


def test_simulated_day_planner_keeps_the_slo_on_fewer_gpus_than_static_max():
    """The simulator replays the seeded trace with the same Planner: same seed, same result; the planner's SLO
    attainment near static max's on far fewer GPU-hours, nothing failed, and 0 -> n at once from zero."""
    from flagscale.planner.replay import Static, planner_pools, replay
    from flagscale.planner.simulate import ReplicaModel, SimPool
    from flagscale.planner.trace import bursty_day

    model, slo = ReplicaModel(), Slo(500, 50)
    ticks = bursty_day(seed=7, peak_rps=40, tick_s=10)
    assert ticks == bursty_day(seed=7, peak_rps=40, tick_s=10) and ticks != bursty_day(seed=8, peak_rps=40, tick_s=10)
    plan = settings(min_replicas=0, max_replicas=10, upscale_delay_s=15, downscale_delay_s=300, start_s=60)
    planned = replay("slo", ticks, planner_pools({None: plan}, model, {None: 0}), slo, 10)
    static = replay("max", ticks, {None: (SimPool(None, model, 10), Static(10))}, slo, 10)
    assert planned.failed == 0 and static.failed == 0
    assert planned.attainment >= static.attainment - 0.05, (planned.attainment, static.attainment)
    assert planned.gpu_s <= 0.6 * static.gpu_s
    assert any(before == 0 and after >= 1 and "held" in why for _, _, before, after, why in planned.changes)
    assert any(after == 0 for _, _, _, after, _ in planned.changes)  # back to zero at night


def test_no_shrinking_while_a_replica_asked_for_still_starts():
    """Serve's target is 1 while the replica starts (0 serving): idle or not, the planner waits for it to serve."""
    planner = Planner(settings(min_replicas=0, downscale_delay_s=10))
    targets = [planner.decide(Observation(t, 0), target_now=1).target for t in range(0, 60, 5)]
    assert set(targets) == {1} and "still start" in planner.decide(Observation(60, 0), target_now=1).reason
    assert 0 in [planner.decide(Observation(t, 1), target_now=1).target for t in range(65, 90, 5)]


def test_a_pool_whose_replicas_sleep_is_sized_in_replicas_awake():
    planner = Planner(settings(min_replicas=0, downscale_delay_s=0))
    # both started, both asleep, nothing asked: none need be awake
    idle = planner.decide(Observation(0, 2, asleep=2))
    assert idle.target == 0 and idle.reason == "idle, 2 asleep"
    # a request arrives: one kept awake at once (no upscale delay from zero), with no replica to start
    woken = planner.decide(Observation(1, 2, asleep=2, running=1, arrival_rps=0.2))
    assert woken.target == 1 and "keep one awake" in woken.reason
    # the one awake carries all the pool's load: capacity is fitted per awake replica, not per replica started
    planner.decide(Observation(2, 2, asleep=1, ttft_ms=100, running=1, arrival_rps=1, prompt_tps=100))
    planner.decide(Observation(3, 2, asleep=1, ttft_ms=300, running=1, arrival_rps=1, prompt_tps=800))
    (ttft,) = [dim for dim in planner.dimensions if dim.name == "ttft"]
    # 800 tok/s at 3x the unloaded latency: saturation at 1.5x that, 0.8 of it within the 500 ms bound
    assert ttft.curve.fitted == pytest.approx(800 * 1.5 * 0.8)  # per replica started, it would be half


def test_a_replica_asleep_is_not_one_still_starting():
    """Target 2 with one awake and one asleep: the planner may go down at once (nothing starts)."""
    planner = Planner(settings(min_replicas=0, downscale_delay_s=0))
    planner.target = 2
    assert planner.decide(Observation(0, 2, asleep=1)).target == 0


def test_a_simulated_pool_that_sleeps_keeps_what_it_lets_go_and_wakes_it_before_starting_more():
    from flagscale.planner.simulate import ReplicaModel, SimPool

    pool = SimPool(None, ReplicaModel(start_s=60, drain_s=30, wake_s=1), serving=3, sleeps=True)
    pool.set_target(0, 1)
    assert (pool.serving, len(pool.draining), pool.replicas_paid()) == (1, 2, 3)
    pool.advance(30)  # drained: asleep, paid no more
    assert (pool.asleep, pool.replicas_paid()) == (2, 1)
    pool.set_target(31, 4)  # two wakes, then one start
    assert len(pool.waking) == 2 and pool.starting == [91] and pool.asleep == 0
    pool.advance(32)
    assert pool.serving == 3 and pool.starting == [91]
    pool.set_target(33, 2)  # the start is called off first
    assert pool.starting == [] and (pool.serving, len(pool.draining)) == (2, 1)
    pool.set_target(34, 3)  # the one about to sleep serves on
    assert (pool.serving, pool.draining, pool.starting) == (3, [], [])
    plain = SimPool(None, ReplicaModel(drain_s=30), serving=2)
    plain.set_target(0, 1)
    plain.advance(30)
    assert (plain.asleep, plain.replicas_paid()) == (0, 1)  # let go: gone
