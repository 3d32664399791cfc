"""Whether an update in place can find room at every step (flagscale/rollout.py), and which changes replace a
node's replicas (flagscale/update.py). The cases are the ones auto_tune met on a 4-GPU host."""

from __future__ import annotations

from flagscale.rollout import Rollout, stuck_at
from flagscale.update import Change, replaced_nodes

GPU = "GPU"


def four_gpus(free: float) -> dict:
    return {"n1": {GPU: free, "CPU": 60.0}}


def olds(*gpus: float) -> list:
    return [("n1", {GPU: g, "CPU": 1.0}) for g in gpus]


def test_two_one_gpu_replicas_cannot_become_two_two_gpu_replicas_on_four_gpus():
    # the first new replica takes the 2 free GPUs; stopping a one-GPU replica then frees 1, and the second needs 2
    rollout = Rollout(four_gpus(2), olds(1, 1), {GPU: 2, "CPU": 1}, count=2, replaced=True, spare=True)
    assert "new replica 2 of 2" in stuck_at(rollout)


def test_two_two_gpu_replicas_cannot_become_four_one_gpu_replicas_without_a_spare():
    # Serve starts the two extra replicas first, while the old ones hold every GPU
    rollout = Rollout(four_gpus(0), olds(2, 2), {GPU: 1, "CPU": 1}, count=4, replaced=True, spare=False)
    assert "extra replica 1 of 2" in stuck_at(rollout)


def test_one_gpu_replica_becomes_a_two_gpu_replica_beside_it():
    rollout = Rollout(four_gpus(3), olds(1), {GPU: 2, "CPU": 1}, count=1, replaced=True, spare=True)
    assert stuck_at(rollout) is None


def test_replicas_of_one_gpu_swapped_one_at_a_time_without_a_spare():
    rollout = Rollout(four_gpus(0), olds(1, 1, 1, 1), {GPU: 1, "CPU": 1}, count=4, replaced=True, spare=False)
    assert stuck_at(rollout) is None


def test_a_pure_scale_down_needs_no_room_and_a_scale_up_needs_room_for_each_new_replica():
    assert stuck_at(Rollout(four_gpus(0), olds(1, 1, 1, 1), {GPU: 1}, count=1, replaced=False)) is None
    assert stuck_at(Rollout(four_gpus(2), olds(1, 1), {GPU: 1}, count=4, replaced=False)) is None
    assert "replica 4 of 4" in stuck_at(Rollout(four_gpus(1), olds(1, 1), {GPU: 1}, count=4, replaced=False))


def test_the_old_replica_stopped_is_one_whose_node_then_fits_a_new_one():
    free = {"a": {GPU: 0}, "b": {GPU: 1}}
    old = [("a", {GPU: 1}), ("b", {GPU: 1})]
    # without a spare: stopping the replica on b leaves 2 GPUs there for a two-GPU replica
    assert stuck_at(Rollout(free, old, {GPU: 2}, count=1, replaced=True, spare=False)) is None


def test_the_facts_are_not_changed_by_the_walk():
    free, old = four_gpus(2), olds(1, 1)
    stuck_at(Rollout(free, old, {GPU: 2, "CPU": 1}, count=2, replaced=True))
    assert free == four_gpus(2) and old == olds(1, 1)


def test_only_changes_beyond_the_replica_count_replace_replicas():
    scale = [Change("serve.a.resources.num_replicas", 4, 1), Change("experiment.runner.deploy.startup_timeout_s", 1, 2)]
    assert replaced_nodes(scale) == []
    bounds = [Change("serve.a.resources.max_replicas", 2, 4)]
    assert replaced_nodes(bounds) == []
    turned_on = [Change("serve.a.resources.num_replicas", 1, None), Change("serve.a.resources.max_replicas", None, 2)]
    assert replaced_nodes(turned_on) == ["a"]
    gpus = [Change("serve.a.resources.num_replicas", 2, 4), Change("serve.b.engine_args.tensor_parallel_size", 2, 1)]
    assert replaced_nodes(gpus) == ["b"]
