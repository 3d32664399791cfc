"""Planning: the validated config and the facts gathered before it (flagscale/facts.py) -> a Plan (engine
deployments, replicas, resources, argv, endpoint) that `run` deploys and `dryrun` prints. Every check that needs
more than the schema runs here, before anything is started.

build.py: build_plan (facts gathered, then plan_of over them) and the whole's checks; inputs.py: PlanInputs, what
planning reads; engine_nodes.py: every engine node planned, serve_ids and served names unique, dryrun's notes;
pools.py: a node's deployments (itself, or its prefill and decode pools); engine_plan.py: one deployment ->
EnginePlan (argv by the engine's parser, one placement decision, per-host argv, a pinned pool's host);
engine_args.py: what a node hands its engine; lora.py: a node's LoRA adapters checked and planned; sleep.py: resources.sleep_delay_s checked against the engine and target; resources.py: GPUs, the head's CPUs, router processes; types.py:
Plan and EnginePlan, and who can reach the plan without a key.

It may import flagscale/facts.py, the launchers (through their interface), cluster/, config/, engines/ and the
basics; never serve/, update.py or the actions above it.
"""

from flagscale.plan.build import build_plan, plan_of
from flagscale.plan.engine_args import engine_args_of, served_names
from flagscale.plan.resources import default_router_processes
from flagscale.plan.types import ROUTER_DEPLOYMENT, EnginePlan, Plan, open_without_key

__all__ = [
    "ROUTER_DEPLOYMENT",
    "EnginePlan",
    "Plan",
    "build_plan",
    "default_router_processes",
    "engine_args_of",
    "open_without_key",
    "plan_of",
    "served_names",
]
