"""The SLO planner inside Serve: what a replica reports (replica_stats), how Serve's series become the planner's
observation (slo_signals.observe), SloPolicy called with Serve's own AutoscalingContext, the autoscaling config
Serve's own schema accepts, and the router's held-request bounds at zero replicas (cold_start.ColdStart)."""

import asyncio
import math

import pytest
from ray.serve._private.common import TimeStampedValue
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from flagscale import engines
from flagscale.replica.autoscaling import with_engine_load_policy
from flagscale.replica.slo_policy import SloPolicy, with_slo_policy
from flagscale.replica.slo_signals import observe, replica_stats
from flagscale.router import cold_start
from flagscale.router.planner_metrics import planner_text
from tests.unit.fakes import FakeHandle

VLLM = engines.get("vllm")
TTFT = "vllm:time_to_first_token_seconds"


def scrape(requests, ttft_fast, prompt, output, running=2.0, waiting=0.0, asleep=False):
    """One replica's engine figures: `requests` finished, `ttft_fast` of them under 0.1 s, the rest under 1 s."""
    sums = {"vllm:prompt_tokens_total": prompt, "vllm:generation_tokens_total": output}
    sums |= {"vllm:request_success_total": requests, "vllm:num_requests_running": running}
    sums |= {"vllm:num_requests_waiting": waiting, "vllm:kv_cache_usage_perc": 0.5}
    buckets = {TTFT: {0.1: ttft_fast, 1.0: requests, math.inf: requests}}
    return replica_stats(VLLM, sums, buckets, start_s=42.0, asleep=asleep)


def series(*stats_at):
    """Serve's raw_metrics for one replica ("r1") from (time, stats) points."""
    raw = {}
    for when, stats in stats_at:
        for key, value in stats.items():
            raw.setdefault(key, {}).setdefault("r1", []).append(TimeStampedValue(when, value))
    return raw


def test_replica_stats_and_the_window_they_make():
    before, after = scrape(100, 100, 10_000, 2_000), scrape(130, 110, 16_000, 3_200, waiting=3)
    assert before["ttft_le:0.1"] == 100 and before["start_s"] == 42.0 and "itl_le:0.1" not in before
    obs = observe(series((0.0, before), (30.0, after)), 30.0, replicas=1, held=0, q=90)
    assert obs.prompt_tps == pytest.approx(200) and obs.output_tps == pytest.approx(40)
    # arrivals: the 30 that finished and the 3 more waiting at the end than at the start, over 30 s
    assert obs.arrival_rps == pytest.approx(1.1) and obs.queue == 3 and obs.kv_usage == 0.5
    # the window's 30 requests: 10 under 0.1 s, 20 under 1 s; the 90th percentile inside the second bucket
    assert obs.ttft_ms == pytest.approx((0.1 + 0.9 * (27 - 10) / 20) * 1000)
    assert obs.itl_ms is None  # no ITL histogram reported


def test_a_ramp_shows_in_the_arrivals_before_its_requests_finish():
    before, after = scrape(100, 100, 10_000, 2_000, running=2.0), scrape(100, 100, 10_000, 2_000, running=12.0)
    obs = observe(series((0.0, before), (5.0, after)), 5.0, replicas=1, held=0, q=90)
    assert obs.arrival_rps == pytest.approx(2.0)  # nothing finished yet, 10 more in flight over 5 s
    drained = observe(series((0.0, after), (5.0, before)), 5.0, replicas=1, held=0, q=90)
    assert drained.arrival_rps == 0.0  # in flight falling with nothing finished: no arrivals, never negative


def test_an_slo_node_looks_back_10_s_and_its_replicas_push_every_2_s():
    scaling = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "downscale_delay_s": 30}}
    config = with_engine_load_policy(scaling, {"ttft_ms": 500}, None)["autoscaling_config"]
    served = AutoscalingConfig(**config)  # Serve's own schema takes them
    assert (served.look_back_period_s, served.metrics_interval_s) == (10.0, 2.0)
    plain = with_engine_load_policy(scaling)["autoscaling_config"]  # request counting: Serve's own cadence
    assert "look_back_period_s" not in plain and "metrics_interval_s" not in plain


def context(raw, current, target, held=0.0):
    return AutoscalingContext(
        deployment_id=None,
        deployment_name="demo",
        app_name="app",
        current_num_replicas=current,
        target_num_replicas=target,
        running_replicas=[],
        total_num_requests=held,
        total_queued_requests=held,
        aggregated_metrics={},
        raw_metrics=raw,
        capacity_adjusted_min_replicas=0,
        capacity_adjusted_max_replicas=4,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=None,
    )


def test_slo_policy_asks_for_more_when_ttft_breaks_the_slo_with_a_queue():
    policy = SloPolicy({"ttft_ms": 200, "percentile": 90}, 1, 4, upscale_delay_s=0, downscale_delay_s=60)
    raw = series((0.0, scrape(100, 100, 10_000, 2_000)), (30.0, scrape(130, 100, 16_000, 3_200, waiting=5)))
    target, state = policy(context(raw, current=1, target=1))
    assert target == 2 and state == {} and policy.changes == 1
    assert "TTFT p90" in policy.planner.last_reason and policy.planner.settings.start_s == 42.0


def test_serve_takes_the_slo_nodes_config_with_the_planner_holding_the_delays():
    resources = {"min_replicas": 0, "max_replicas": 3, "upscale_delay_s": 5, "downscale_delay_s": 40}
    scaling = with_engine_load_policy({"autoscaling_config": resources}, {"ttft_ms": 500, "percentile": 90}, "decode")
    config = AutoscalingConfig(**scaling["autoscaling_config"])  # Serve's own schema
    assert config.upscale_delay_s == 0 and config.downscale_delay_s == 0 and config.initial_replicas == 1
    kwargs = config.policy.policy_kwargs
    assert kwargs["downscale_delay_s"] == 40 and kwargs["role"] == "decode" and kwargs["min_replicas"] == 0
    assert config.policy.policy_function == "flagscale.replica.slo_policy:SloPolicy"
    plain = AutoscalingConfig(
        **with_engine_load_policy({"autoscaling_config": {"max_replicas": 2}})["autoscaling_config"]
    )
    assert plain.policy.policy_function.endswith(":engine_load_policy") and plain.downscale_delay_s == 600
    assert "slo" not in with_slo_policy({"slo": {"ttft_ms": 1}}, None)


def test_held_requests_wait_bounded_and_past_the_bound_get_one_503_with_retry_after(monkeypatch):
    monkeypatch.setattr(cold_start, "POLL_S", 0.01)
    handle = FakeHandle()
    cold = cold_start.ColdStart({"demo": handle}, lambda serve_id: None)
    ready = {"now": False}

    async def refresh():
        return None

    async def scenario():
        waiting = asyncio.create_task(cold.hold("m", "demo", 5.0, lambda: ready["now"], refresh))
        for _ in range(500):  # bounded: the wake goes out from a worker thread
            if handle.wakes:
                break
            await asyncio.sleep(0.01)
        assert cold.held == {"m": 1} and handle.wakes == 1  # Serve was asked at once, once
        ready["now"] = True
        assert await waiting is None and cold.held == {"m": 0}
        ready["now"] = False
        refused = await cold.hold("m", "demo", 0.05, lambda: False, refresh)
        assert refused.status == 503 and refused.headers["Retry-After"] == "10"
        assert b"started within" in refused.body and cold.timeouts == 1
        monkeypatch.setattr(cold_start, "MAX_HELD_PER_MODEL", 0)
        full = await cold.hold("m", "demo", 5.0, lambda: True, refresh)
        assert full.status == 503 and b"already wait" in full.body

    asyncio.run(scenario())


def test_measured_start_time_bounds_the_wait():
    cold = cold_start.ColdStart({}, lambda serve_id: 20.0)
    assert asyncio.run(cold.bound_s("demo", 900.0)) == 2 * 20.0 + cold_start.MARGIN_S
    assert asyncio.run(cold_start.ColdStart({}, lambda s: None).bound_s("demo", 900.0)) == 900.0


def test_planner_series_on_metrics():
    text = planner_text({"demo": {"changes": 3, "target": 2}}, {"m": 1}, 0)
    assert 'flagscale_router_planner_changes_total{serve_id="demo"} 3' in text
    assert 'flagscale_router_held_requests{model="m"} 1' in text
    assert "planner_measured" not in text
    record = {"target": 2, "desired": 3, "measured": {"itl_ms": 41.5, "queue": 2.0}, "forecast": {"work_tps": 9e3}}
    text = planner_text({"demo": record}, {}, 0)
    assert 'flagscale_router_planner_desired_replicas{serve_id="demo"} 3' in text
    assert 'flagscale_router_planner_measured{serve_id="demo",signal="itl_ms"} 41.5' in text
    assert 'flagscale_router_planner_forecast{serve_id="demo",signal="work_tps"} 9000' in text
    assert planner_text({}, {}, 0) == ""


def test_the_router_holds_a_request_at_zero_replicas_and_serves_it_once_one_joins(monkeypatch):
    """A real router (no Ray): model "m" has no replica; with scale_from_zero it wakes the deployment once and
    serves the request when the (fake) replica joins the table; without, the old immediate 503."""
    import aiohttp

    from flagscale.router.replicas import ReplicaTable
    from tests.conftest import bare_router, router_listening
    from tests.unit.fakes import FakeEngine, started_upstreams

    monkeypatch.setattr(cold_start, "POLL_S", 0.01)
    body = {"model": "m", "prompt": "hi", "max_tokens": 3}

    async def scenario(scale_from_zero):
        engine = FakeEngine("late")
        (joined,) = await started_upstreams([engine])
        router = bare_router([], "least_load")
        router.spec.scale_from_zero = scale_from_zero
        handle = FakeHandle()
        router.failover.cold_start = cold_start.ColdStart({"s": handle}, lambda serve_id: None)
        reads = []

        async def refresh():  # the registry read: the replica is listed from the third read on
            reads.append(1)
            if len(reads) >= 3:
                router.replicas.table = ReplicaTable(by_model={"m": [joined]}, by_replica={"late": joined})

        router.failover._refresh = refresh
        try:
            async with router_listening(router) as url, aiohttp.ClientSession() as client:
                async with client.post(f"{url}/v1/completions", json=body) as resp:
                    return resp.status, await resp.read(), handle.wakes, router.failover.cold_start.held
        finally:
            await engine.runner.cleanup()

    status, answer, wakes, held = asyncio.run(scenario({"m": 5.0}))
    assert status == 200 and answer and wakes == 1 and held == {"m": 0}
    status, answer, wakes, _ = asyncio.run(scenario({}))
    assert status == 503 and b"no ready replica" in answer and wakes == 0


def test_status_planner_table_shows_slo_measured_forecast_target_and_reason():
    from rich.console import Console
    from rich.table import Table

    from flagscale.actions.status_planner import planner_table

    record = {
        "slo": {"ttft_ms": 500, "itl_ms": 50, "percentile": 90},
        "bounds": [0, 4],
        "replicas": 1,
        "target": 2,
        "reason": "work 900 tok/s / 500 per replica within ttft SLO -> 2",
        "last_change": "work 900 tok/s / 500 per replica within ttft SLO -> 2",
        "measured": {"ttft_ms": 620.0, "queue": 3, "arrival_rps": 1.5, "prompt_tps": 700, "output_tps": 50},
        "forecast": {"horizon_s": 45, "arrival_rps": 2.0, "work_tps_per_replica": 500},
    }
    table = Table(*["pool", "SLO", "measured", "forecast", "replicas", "last change"])
    console = Console(width=400, record=True)
    console.print(planner_table({"chat": record}, table))
    text = console.export_text()
    for shown in ("p90 TTFT 500 ms, ITL 50 ms", "TTFT 620 ms", "3 queued", "in 45 s: 2 req/s", "1 -> 2 (0..4)"):
        assert shown in text, text
    assert "within ttft SLO -> 2" in text and "(now:" not in text
    record["reason"] = "idle [in 10 s if it lasts]"
    console.print(planner_table({"chat": record}, Table(*["pool", "SLO", "measured", "forecast", "r", "last"])))
    assert "(now: idle [in 10 s if it lasts])" in console.export_text()


def test_auto_tunes_best_trial_seeds_the_planner_of_the_node_it_tuned(tmp_path, demo_model_path):
    """A history.csv in the exp_dir (auto_tune's): the SLO node's planner starts from what one replica of the best
    trial sustained, per replica (its output and prompt tokens/s), until it has fitted its own figures."""
    from flagscale.config.load import ConfigSources, load_config
    from flagscale.facts import TargetFacts, gather
    from flagscale.plan.build import plan_of
    from flagscale.tune import history

    rows = [  # two instances in the best trial: per replica is half of what it measured
        {"instance": 2, "status": "done", "goodput_per_device": 3.0, "output_throughput": 400.0,
         "total_token_throughput": 1200.0},
        {"instance": 1, "status": "done", "goodput_per_device": 1.0, "output_throughput": 100.0,
         "total_token_throughput": 300.0},
        {"instance": 4, "status": "failed", "reason": "x"},
    ]  # fmt: skip
    exp = tmp_path / "exp"
    history.write(exp / "auto_tuner" / history.FILE, ["instance"], rows)
    node = {
        "serve_id": "m",
        "engine_args": {"model": str(demo_model_path), "max_model_len": 256},
        "resources": {"min_replicas": 1, "max_replicas": 2, "slo": {"ttft_ms": 500}},
    }
    sources = ConfigSources(main="conf/serve.yaml", serve="conf/serve/nodes.yaml")
    cfg = load_config(
        {"experiment": {"exp_name": "t", "exp_dir": str(exp), "runner": {"deploy": {"port": 8123}}}, "serve": [node]},
        sources,
    )
    facts = gather(cfg, sources, check_port=False, target=TargetFacts(cpus=8))
    assert facts.tuned == {"m": {"seed_output_tps": 200.0, "seed_prompt_tps": 400.0}}
    engine = plan_of(cfg, sources, facts).engines[0]
    assert "seeded by auto_tune: 200 output tok/s a replica" in engine.describe_replicas()
    scaling = with_engine_load_policy(engine.serve_scaling(), engine.autoscaling["slo"], None)
    kwargs = AutoscalingConfig(**scaling["autoscaling_config"]).policy.policy_kwargs
    assert "seeds" not in kwargs["slo"] and kwargs["seed_output_tps"] == 200.0
    settings = SloPolicy(**kwargs).planner.settings
    assert (settings.seed_prompt_tps, settings.seed_output_tps) == (400.0, 200.0)


def test_a_node_that_sleeps_keeps_its_replicas_in_serve_and_plans_the_ones_awake():
    resources = {"min_replicas": 1, "max_replicas": 3, "downscale_delay_s": 300, "upscale_delay_s": 0}
    scaling = with_engine_load_policy({"autoscaling_config": resources}, {"ttft_ms": 200}, None, sleep_delay_s=0)
    config = AutoscalingConfig(**scaling["autoscaling_config"])  # Serve's own schema
    kwargs = config.policy.policy_kwargs
    assert kwargs["sleep_delay_s"] == 0 and config.initial_replicas == 3  # all started; the unwanted ones sleep
    policy = SloPolicy(**kwargs)
    assert policy.sleeps and policy.planner.settings.downscale_delay_s == 0  # fewer awake: a wake to undo
    raw = {}
    for replica, asleep in (("r1", True), ("r2", False)):
        stats = scrape(100, 100, 10_000, 2_000, running=0.0, asleep=asleep)
        for key, value in stats.items():
            raw.setdefault(key, {})[replica] = [TimeStampedValue(0.0, value), TimeStampedValue(10.0, value)]
    # idle: none need be awake (below min_replicas, which bounds the replicas started), and Serve keeps both
    target, _ = policy(context(raw, current=2, target=2))
    assert target == 2 and policy.planner.target == 0 and policy.planner.last_reason.startswith("idle")
    # both awake, TTFT past the SLO with a queue: a third awake is wanted, and Serve asked to start it
    busy = SloPolicy(**kwargs)
    raw = {}
    for replica in ("r1", "r2"):
        points = ((0.0, scrape(100, 100, 10_000, 2_000)), (30.0, scrape(130, 100, 16_000, 3_200, waiting=5)))
        for when, stats in points:
            for key, value in stats.items():
                raw.setdefault(key, {}).setdefault(replica, []).append(TimeStampedValue(when, value))
    assert busy(context(raw, current=2, target=2))[0] == 3 and busy.planner.target == 3
