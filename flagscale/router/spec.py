"""What a router is given: the models it serves, their routing, its bounds (RouterSpec), and what of it a running
router takes in place (Serve's user_config -> Router.reconfigure)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from flagscale.config.routing import Admission, RoutingSpec
from flagscale.replica import registry
from flagscale.router.keyring import AcceptedKey, current_keys, keys_from_json

GRAPH_MAX_ONGOING = 1000  # the graph driver deployment's max_ongoing_requests (flagscale/serve/app.py)


def fixed(**kwargs: Any) -> Any:
    """A RouterSpec field fixed for the router replica's life: not in its user_config, which a running router takes in
    place (Router.reconfigure). Where it listens, and secrets (Serve shows user_configs in its status), are fixed."""
    return field(metadata={"fixed": True}, **kwargs)


@dataclass(frozen=True)
class LoraNode:
    """An engine node with LoRA adapters, as the router's admin call needs it (router/adapter_admin.py)."""

    base: str  # the node's first served name: the adapters' `parent`
    served: list[str]  # every name the node's base model is served by
    model: str  # the model as its engine loads it: an added adapter's base must be this one
    max_lora_rank: int  # an added adapter's rank bound
    default_rank_limit: bool  # whether that bound is the engine's default (the error then says how to raise it)
    adapters: dict[str, str] = field(default_factory=dict)  # its configured set: name -> directory


@dataclass
class RouterSpec:
    app: str = fixed()
    host: str = fixed()
    port: int = fixed()
    models: dict[str, str]  # served model name -> serve_id
    refresh_s: float = registry.ROUTER_REFRESH_S
    graph_route: str | None = None  # deployment graph entry (POST, JSON in/out), served by the graph driver
    # stay off the cores of engine workers on this host (flagscale/replica/cpu_layout.py)
    pin_cpus: bool = fixed(default=True)
    routing: dict[str, RoutingSpec] = field(default_factory=dict)  # served model name -> its node's routing
    # Disaggregated models: served model name -> how its prefill replica is picked (docs/disaggregation.md).
    prefill_routing: dict[str, RoutingSpec] = field(default_factory=dict)
    # deploy.api_key: the client keys accepted on every route but /health, as digests with their ends (keyring.py),
    # so that a new key reaches a running router in place; none: a router without a key
    client_keys: tuple[AcceptedKey, ...] = ()
    # what the engines require (keyring.engine_key), sent in place of the client's Authorization; never a client's
    engine_key: str | None = fixed(default=None, repr=False)
    protect_metrics: bool = True  # deploy.protect_metrics: /metrics needs the key too
    max_ongoing: dict[str, int] = field(default_factory=dict)  # serve_id -> requests one replica is sent at once
    admission: Admission = field(default_factory=Admission)  # body cap; queue bounds, per model
    # served model names whose engine gives no token ids (capabilities.resume_from_tokens): a stream of theirs moves
    # to another replica only before its first byte
    no_resume: list[str] = field(default_factory=list)
    # served model name -> its engine kind (flagscale/engines/), whose public paths the router passes on
    # (flagscale/router/surface.py); a model not named here: the default engine's
    engines: dict[str, str] = field(default_factory=dict)
    # The deployment's secret that authenticates the router processes' routing hints to each other (peers.py), and
    # under which client_keys are digested (keyring.py):
    # in the init args only (Serve's status shows user_configs), never in repr, logs or the state file.
    peer_secret: str | None = fixed(default=None, repr=False)
    # deploy.router_processes > 1 (each process a Router): share load, metrics, drains and routing hints with the
    # others (flagscale/router/peers.py; needs Ray's GCS). Off only where no Ray runs (benchmarks, tests).
    share_with_peers: bool = fixed(default=True)
    # deploy.router_processes: the kernel spreads clients over them, so each admits its share of every limit (a
    # replica's max_ongoing, the queue, the graph route's): N processes together admit what one would
    processes: int = 1
    # LoRA adapters served as models (in `models` too): adapter -> its node's base model name; and per engine
    # deployment with adapters (serve_id), the adapters one replica runs at once (flagscale/router/lora.py)
    adapters: dict[str, str] = field(default_factory=dict)
    max_loras: dict[str, int] = field(default_factory=dict)
    lora_nodes: dict[str, LoraNode] = field(default_factory=dict)  # serve_id -> its node, for nodes with LoRA
    graph_max_ongoing: int = GRAPH_MAX_ONGOING  # graph requests in flight at once, all processes together
    # served model name -> the most seconds a request waits for the first replica of its node at zero replicas
    # (min_replicas 0, colocated; flagscale/router/cold_start.py) where no start time was measured yet
    scale_from_zero: dict[str, float] = field(default_factory=dict)
    # disaggregated models with a pool that may scale to zero: model -> {"prefill" / "decode": that pool's serve_id}.
    # A request waits (as above) for a decode pool at zero; a prefill pool at zero is asked for a replica while the
    # decode pool computes the prompts itself (decode-only)
    zero_pools: dict[str, dict[str, str]] = field(default_factory=dict)
    # nodes whose SLO planner sizes the replicas kept awake (slo with sleep_delay_s): their requests go to the
    # planner's target count of replicas, the others idle into sleep (flagscale/router/wake.py)
    awake_planned: list[str] = field(default_factory=list)

    def share(self, limit: int) -> int:
        """This process's share of a deployment-wide limit (at least 1)."""
        return max(1, math.ceil(limit / max(1, self.processes)))

    def with_api_key(self, key: str | None) -> RouterSpec:
        """One key for clients and engines alike (a router outside a deployment: benchmarks, tests)."""
        return replace(self, client_keys=current_keys(self.peer_secret, key), engine_key=key)

    def user_config(self) -> dict[str, Any]:
        """What a running router takes in place (Serve's user_config -> Router.reconfigure): every field not fixed."""
        return {key: value for key, value in asdict(self).items() if key in RECONFIGURABLE}

    def reconfigured(self, config: dict[str, Any]) -> RouterSpec:
        config = dict(config)
        for key in ("routing", "prefill_routing"):
            config[key] = {model: RoutingSpec.from_json(spec) for model, spec in config.get(key, {}).items()}
        if "client_keys" in config:
            config["client_keys"] = keys_from_json(config["client_keys"])
        if "lora_nodes" in config:
            config["lora_nodes"] = {serve_id: LoraNode(**node) for serve_id, node in config["lora_nodes"].items()}
        if "admission" in config:
            bounds = config["admission"]
            config["admission"] = Admission(**bounds | {"allowed_hosts": tuple(bounds.get("allowed_hosts", ()))})
        return replace(self, **config)

    def with_adapter_sets(self, sets: dict[str, dict[str, str]]) -> RouterSpec:
        """This spec with the adapter sets given at run time (serve_id -> set: replica/runtime_adapters.py) in place
        of those nodes' configured adapters: each adapter a model of its node, routed and served as its base."""
        models, adapters, routing, engines = (
            dict(self.models),
            dict(self.adapters),
            dict(self.routing),
            dict(self.engines),
        )
        no_resume = set(self.no_resume)
        for serve_id, given in sets.items():
            node = self.lora_nodes.get(serve_id)
            if node is None:  # a node an update removed, or one without LoRA
                continue
            for name in [name for name, base in adapters.items() if base == node.base]:
                for table in (adapters, models, routing, engines):
                    table.pop(name, None)
                no_resume.discard(name)
            for name in given:
                if name in models:  # another node's model (the admin call refuses such a name)
                    continue
                adapters[name], models[name] = node.base, models[node.base]
                for table in (routing, engines):
                    if node.base in table:
                        table[name] = table[node.base]
                if node.base in no_resume:
                    no_resume.add(name)
        return replace(
            self, models=models, adapters=adapters, routing=routing, engines=engines, no_resume=sorted(no_resume)
        )


RECONFIGURABLE = tuple(spec.name for spec in fields(RouterSpec) if not spec.metadata.get("fixed"))
