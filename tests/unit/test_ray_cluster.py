"""`runner.type`: which launcher a config selects and what it refuses; an existing Ray cluster's address, where
replicas would go on its nodes (first fit, the arithmetic when they do not fit), accelerators it already has."""

from __future__ import annotations

import socket
import time

import pytest
from pydantic import ValidationError

from flagscale.cluster.ray_existing import check_answers, place, resolve_address
from flagscale.cluster.ray_facts import ClusterFacts, NodeFacts, accelerator_requirement
from flagscale.config.schema import RunnerConfig
from flagscale.errors import ClusterError, ConfigError
from flagscale.launchers import cluster_kind

WHERE = "conf/serve.yaml"


@pytest.mark.parametrize(
    "runner, kind",
    [
        ({}, "local"),
        ({"type": "ssh"}, "local"),
        ({"hostfile": "hosts"}, "ssh"),
        ({"type": "ssh", "hostfile": "hosts"}, "ssh"),
        ({"type": "ray", "address": "10.0.0.5:6379"}, "ray"),
        ({"type": "ray"}, "ray"),  # the address may come from RAY_ADDRESS
    ],
)
def test_runner_type_selects_the_launcher(runner, kind):
    assert cluster_kind(RunnerConfig(**runner), WHERE) == kind


@pytest.mark.parametrize(
    "runner, key, words",
    [
        ({"type": "cloud"}, "experiment.runner.type", ["KubeRay", "runner.type: ray"]),
        ({"type": "ray", "hostfile": "hosts"}, "experiment.runner.hostfile", ["one of them"]),
        ({"address": "10.0.0.5:6379"}, "experiment.runner.address", ["needs runner.type: ray"]),
        ({"type": "ray", "ray_port": 6380}, "experiment.runner.ray_port", ["used as they are"]),
        ({"type": "ray", "num_cpus": 4}, "experiment.runner.num_cpus", ["used as they are"]),
    ],
)
def test_what_runner_type_refuses_names_the_key(runner, key, words):
    with pytest.raises(ConfigError) as info:
        cluster_kind(RunnerConfig(**runner), WHERE)
    assert info.value.where == f"{WHERE}: {key}"
    for word in words:
        assert word in str(info.value)


def test_an_unknown_runner_type_is_a_schema_error():
    with pytest.raises(ValidationError):
        RunnerConfig(type="kubernetes")


def test_address_from_the_config_wins_over_ray_address():
    assert resolve_address("10.0.0.5:6379", {"RAY_ADDRESS": "10.0.0.9:6379"}, WHERE) == "10.0.0.5:6379"
    assert resolve_address(None, {"RAY_ADDRESS": "10.0.0.9:6379"}, WHERE) == "10.0.0.9:6379"


@pytest.mark.parametrize(
    "address, environ, named, words",
    [
        (None, {}, f"{WHERE}.address", ["RAY_ADDRESS", "experiment.runner.address"]),
        ("ray://head:10001", {}, f"{WHERE}.address", ["Ray Client", "kubectl exec"]),
        (None, {"RAY_ADDRESS": "head"}, "RAY_ADDRESS", ["not a host:port"]),
        ("head:99999", {}, f"{WHERE}.address", ["not a host:port"]),
    ],
)
def test_bad_addresses_name_where_they_came_from(address, environ, named, words):
    with pytest.raises(ConfigError) as info:
        resolve_address(address, environ, WHERE)
    assert info.value.where == named
    for word in words:
        assert word in str(info.value)


def test_an_address_nobody_answers_fails_within_seconds_naming_it():
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as info:
        check_answers(f"127.0.0.1:{port}", timeout_s=2)
    assert time.monotonic() - t0 < 5
    assert info.value.where == f"127.0.0.1:{port}"
    assert "nobody answers" in str(info.value)


def node(ip, cpus, gpus=0, head=False, free=None, **custom) -> NodeFacts:
    total = {"CPU": float(cpus), "GPU": float(gpus), "memory": 1e9, f"node:{ip}": 1.0, **custom}
    if head:
        total["node:__internal_head__"] = 1.0
    return NodeFacts(f"id-{ip}", ip, head, total, dict(free if free is not None else total))


FACTS = ClusterFacts(
    "10.0.0.1:6379",
    [node("10.0.0.1", 4, head=True, free={"CPU": 2.0}), node("10.0.0.2", 8, gpus=2, **{"accelerator_type:H100": 1.0})],
)


def test_replicas_go_to_the_first_node_with_room_biggest_first():
    placement = place([("small", 2, {"CPU": 1.0}, {}), ("big", 1, {"CPU": 6.0}, {})], FACTS, free=True, where=WHERE)
    assert placement.lines() == ["10.0.0.2: big#0", "10.0.0.1: small#0, small#1"]
    assert place([("small", 3, {"CPU": 1.0}, {})], FACTS, free=True, where=WHERE).lines() == [
        "10.0.0.1: small#0, small#1",
        "10.0.0.2: small#2",
    ]


def test_what_does_not_fit_is_refused_with_the_arithmetic():
    with pytest.raises(ConfigError) as info:
        place([("big", 1, {"CPU": 6.0}, {}), ("m", 3, {"CPU": 1.0, "GPU": 1.0}, {})], FACTS, free=True, where=WHERE)
    message = str(info.value)
    assert "serve 'm': 3 replica(s) x (CPU:1, GPU:1) = CPU:3, GPU:3" in message
    assert "10.0.0.1 (head): CPU:2; 10.0.0.2: CPU:8, GPU:2" in message
    assert "2 of the 3 fit, beside the replicas of big placed first" in message
    assert info.value.where == WHERE


def test_totals_are_used_when_the_deployment_already_holds_its_share():
    assert place([("m", 1, {"CPU": 4.0}, {})], FACTS, free=False, where=WHERE).lines() == ["10.0.0.1: m#0"]


def test_accelerators_are_what_the_cluster_already_has():
    assert accelerator_requirement("H100", FACTS, WHERE) == ("resource", "accelerator_type:H100")
    chips = ClusterFacts("a:1", [node("10.0.0.3", 4, chipA=8.0)])
    assert accelerator_requirement("chipA", chips, WHERE) == ("devices", "chipA")
    assert accelerator_requirement("L4", LABELLED, WHERE) == ("label", "ray.io/accelerator-type")
    with pytest.raises(ConfigError) as info:
        accelerator_requirement("A100", FACTS, WHERE)
    assert "accelerator types: H100; custom resources: none; labels: none" in str(info.value)


LABELLED = ClusterFacts(
    "10.0.0.1:6379",
    [
        node("10.0.0.1", 8, head=True),
        NodeFacts("id-l4", "10.0.0.7", False, {"CPU": 2.0}, {"CPU": 2.0}, {"ray.io/accelerator-type": "L4"}),
    ],
)


def test_a_labelled_chip_is_a_label_selector_and_placement_keeps_to_those_nodes():
    from flagscale.cluster.placement import Target, reserve
    from flagscale.config.schema import Resources

    reservation = reserve(Resources(accelerator="L4"), (1, 1, 1), Target.ray_cluster(LABELLED), "PACK", WHERE, WHERE)
    assert reservation.ray_actor_options == {"num_cpus": 1, "label_selector": {"ray.io/accelerator-type": "L4"}}
    labels = {"ray.io/accelerator-type": "L4"}
    assert place([("m", 2, {"CPU": 1.0}, labels)], LABELLED, free=True, where=WHERE).lines() == ["10.0.0.7: m#0, m#1"]
    with pytest.raises(ConfigError) as info:  # the head has 8 CPUs free, but not the label
        place([("m", 3, {"CPU": 1.0}, labels)], LABELLED, free=True, where=WHERE)
    assert "(nodes labelled ray.io/accelerator-type=L4) 10.0.0.7: CPU:2; 2 of the 3 fit" in str(info.value)


def test_a_replica_on_a_custom_chip_reserves_that_resource_only():
    from flagscale.cluster.placement import Target, reserve
    from flagscale.config.schema import Resources

    chips = ClusterFacts("a:1", [node("10.0.0.3", 4, chipA=8.0)])
    reservation = reserve(Resources(accelerator="chipA"), (2, 1, 1), Target.ray_cluster(chips), "PACK", WHERE, WHERE)
    assert reservation.ray_actor_options == {"num_cpus": 1, "resources": {"chipA": 2.0}}
    typed = reserve(
        Resources(accelerator="H100", num_gpus=1), (1, 1, 1), Target.ray_cluster(FACTS), "PACK", WHERE, WHERE
    )
    assert typed.ray_actor_options == {"num_cpus": 1, "num_gpus": 1, "resources": {"accelerator_type:H100": 0.001}}
