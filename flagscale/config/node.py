"""One node of the `serve:` list: an engine node (its engine, args, resources, routing, disaggregation) or a
custom Python node."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_type_hints

from pydantic import (
    BaseModel,
    Field,
    create_model,
    field_validator,
    model_validator,
)

from flagscale import engines
from flagscale.config.experiment import ProfileConfig
from flagscale.config.fields import ENGINES, SAFE_ID, Strict
from flagscale.config.lora import LoraConfig
from flagscale.router import policies

# How the router picks an engine node's replica per request: a name in the policies' registry
# (flagscale/router/policies/, docs/routing.md).
RoutingPolicy = Literal[tuple(policies.POLICIES)]


# Engine args a node must opt into (allow_engine_args), per engine kind (EngineKind.unsafe_args)
UNSAFE_ARGS = "; ".join(
    f"{name}: {', '.join(engines.get(name).unsafe_args)}" for name in ENGINES if engines.get(name).unsafe_args
)


class Slo(Strict):
    """A pool's latency objective (docs/autoscaling.md): the SLO planner sizes the pool so that the given
    percentile of time to first token and of inter-token latency stays under these bounds."""

    ttft_ms: float | None = Field(None, gt=0, description="Time to first token, milliseconds, at the percentile.")
    itl_ms: float | None = Field(None, gt=0, description="Inter-token latency, milliseconds, at the percentile.")
    percentile: float = Field(90, gt=0, lt=100, description="The percentile both bounds hold at (default 90).")

    @model_validator(mode="after")
    def _some_bound(self) -> Slo:
        if self.ttft_ms is None and self.itl_ms is None:
            raise ValueError("slo needs ttft_ms, itl_ms or both")
        return self


class Resources(Strict):
    """Replicas and what each replica reserves. Engine nodes reserve devices for TP x PP x DP themselves."""

    num_replicas: int | Literal["auto"] | None = Field(
        None, description="Fixed replica count, or auto: as many as the target's devices fit."
    )
    min_replicas: int | None = Field(None, ge=0, description="Autoscaling (instead of num_replicas): lower bound.")
    max_replicas: int | None = Field(None, ge=1, description="Autoscaling: upper bound.")
    target_ongoing_requests: float | None = Field(
        None, gt=0, description="Autoscaling: in-flight requests per replica."
    )
    upscale_delay_s: float | None = Field(None, ge=0, description="Autoscaling: load must last this long to add.")
    downscale_delay_s: float | None = Field(None, ge=0, description="Autoscaling: idle this long to remove.")
    sleep_delay_s: float | None = Field(
        None,
        gt=0,
        description="Engines with a sleep mode (docs/engines.md): idle this long, a replica sleeps (its weights "
        "off the device or unloaded, its KV cache freed) instead of holding its memory, and wakes for the next "
        'request (docs/operations.md, "Idle replicas asleep").',
    )
    slo: Slo | None = Field(
        None, description="Autoscaling on latency (docs/autoscaling.md): the SLO planner sizes the replicas for it."
    )
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        description="Requests one replica takes at once; the router holds further ones in its queue "
        "(deploy.max_queued_requests). Default: 1000 for engine nodes (well above an engine's max_num_seqs: the "
        "rest queues inside the engine), Ray Serve's for custom nodes.",
    )
    num_cpus: float | None = Field(
        None, ge=0, description="Logical CPUs per replica (default: CPU engines TP x PP x DP, others 1)."
    )
    num_gpus: float | None = Field(
        None,
        ge=0,
        description="GPUs per replica (default: TP x PP x DP on GPU). Replicas sharing a GPU (a fraction) start "
        "one after another, each sizing its KV cache from the memory it finds free, unless their engine args give "
        "the KV cache a size of its own (kv_cache_memory_bytes): then they start together.",
    )
    accelerator: str | None = Field(None, description="Hostfile chip type the replica must land on.")
    memory: int | None = Field(None, ge=0, description="Bytes of RAM reserved per replica.")

    @field_validator("num_replicas")
    @classmethod
    def _count(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 1:
            raise ValueError("num_replicas must be at least 1 (or auto)")
        return value

    @model_validator(mode="after")
    def _replicas(self) -> Resources:
        autoscale = [
            self.min_replicas,
            self.max_replicas,
            self.target_ongoing_requests,
            self.upscale_delay_s,
            self.downscale_delay_s,
        ]
        if self.num_replicas is not None and any(v is not None for v in autoscale):
            raise ValueError("give either num_replicas or min_replicas/max_replicas, not both")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        if self.slo is not None and (self.min_replicas is None or self.max_replicas is None):
            raise ValueError("slo needs min_replicas and max_replicas beside it (the bounds the planner keeps to)")
        if self.slo is not None and self.target_ongoing_requests is not None:
            raise ValueError("give either slo or target_ongoing_requests, not both")
        return self

    @property
    def autoscaling(self) -> bool:
        return any(
            v is not None
            for v in (
                self.min_replicas,
                self.max_replicas,
                self.target_ongoing_requests,
                self.upscale_delay_s,
                self.downscale_delay_s,
            )
        )


def _routing_options() -> type[Strict]:
    """`routing_options`: the settings of every policy's settings type (Policy.settings_type, each declared with
    base.py's `setting`), each key once: those of one or some policies first, in POLICIES' order, then those every
    policy has. A setting two policies declare apart must be declared alike. NodeConfig checks that the keys a node
    sets are settings of its own policy (check_routing_options)."""
    declared: dict[str, tuple[dataclasses.Field, Any]] = {}
    owners: dict[str, list[str]] = {}
    for name, policy in policies.POLICIES.items():
        hints = get_type_hints(policy.settings_type)
        for setting in dataclasses.fields(policy.settings_type):
            first, hint = declared.setdefault(setting.name, (setting, hints[setting.name]))
            if (first.default, first.metadata, hint) != (setting.default, setting.metadata, hints[setting.name]):
                raise TypeError(f"routing setting {setting.name!r} is declared twice, differently (by {name})")
            owners.setdefault(setting.name, []).append(name)
    fields = {}
    for key in sorted(declared, key=lambda key: len(owners[key]) == len(policies.POLICIES)):  # a stable sort
        setting, hint = declared[key]
        who = "Every policy" if len(owners[key]) == len(policies.POLICIES) else ", ".join(owners[key])
        meta = setting.metadata
        fields[key] = (hint, Field(setting.default, ge=meta["ge"], le=meta["le"], description=f"{who}: {meta['doc']}"))
    return create_model(
        "RoutingOptions", __base__=Strict, __doc__="Settings of the routing policies (docs/routing.md).", **fields
    )


RoutingOptions = _routing_options()


def check_routing_options(policy: str | None, options: BaseModel) -> None:
    """The `routing_options` an engine node sets are settings of its policy (`routing`; unset: the default)."""
    name = policy or policies.DEFAULT_POLICY
    own = policies.POLICIES[name].settings_type.names()
    foreign = sorted(options.model_fields_set - set(own))
    if foreign:
        owners = [other for other, kind in policies.POLICIES.items() if foreign[0] in kind.settings_type.names()]
        raise ValueError(
            f"routing_options.{foreign[0]} is a setting of {' and '.join(owners)}, not of routing {name} (whose "
            f"settings are: {', '.join(own)})"
        )


class PoolConfig(Strict):
    """One engine pool of a disaggregated node: its replicas, and what differs from the node's settings."""

    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Merged over the node's engine_args for this pool's engines."
    )
    resources: Resources | None = Field(
        None, description="This pool's replicas and what each reserves (default: the node's resources)."
    )
    host: str | None = Field(None, description="Hostfile host every replica of the pool is pinned to.")


class Disaggregation(Strict):
    """Prefill/decode disaggregation of an engine node (docs/disaggregation.md): a prefill pool computes each
    prompt's KV cache, the KV connector moves it to a decode replica, which streams the answer."""

    prefill: PoolConfig = Field(default_factory=PoolConfig, description="The prefill pool: see PoolConfig.")
    decode: PoolConfig = Field(default_factory=PoolConfig, description="The decode pool: see PoolConfig.")
    kv_connector: str = Field(
        "NixlConnector",
        min_length=1,
        description="The engine's KV connector moving the KV cache (kv_transfer_config).",
    )
    kv_connector_extra_config: dict[str, Any] = Field(
        default_factory=dict, description="The connector's own settings (kv_transfer_config.kv_connector_extra_config)."
    )
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute",
        description="A decode engine whose KV transfer fails: recompute the prompt itself, or fail the request.",
    )
    prefill_routing: RoutingPolicy | None = Field(
        None, description="How the prefill replica is picked (default: the node's routing); decode: the node's."
    )


class NodeConfig(Strict):
    """A graph node: an engine node (`engine: vllm`, or no `module` under task.backend vllm) or a custom Python
    node (`module` + `name`)."""

    serve_id: str = Field(min_length=1, description="Unique node name; the Serve deployment; default model name.")
    engine: str | None = Field(
        None,
        description=f"An engine kind of flagscale/engines/: {', '.join(ENGINES)} (docs/engines.md says which ones "
        "serve here); default task.backend.",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="The engine's own args (docs/engines.md), and FlagScale's common ones."
    )
    engine_args_specific: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per engine: args merged over engine_args for that engine only."
    )
    allow_engine_args: list[str] = Field(
        default_factory=list,
        description="Engine node: engine args that hand every client of the endpoint more than the model (remote "
        "code, shell tools, files read or written at a client's request), opted into by name, e.g. "
        f"`allow_engine_args: [tools]`; without it they are refused. Per engine: {UNSAFE_ARGS}.",
    )
    lora: LoraConfig | None = Field(
        None,
        description="Engine node: LoRA adapters of its model, each served as a model of its own (docs/routing.md): "
        "below. The engine args enable_lora / lora_modules / max_loras / max_lora_rank / max_cpu_loras say the "
        "same.",
    )
    resources: Resources = Field(default_factory=Resources, description="Replicas and what each reserves: below.")
    module: str | None = Field(None, description="Custom node: its .py file (docs/graphs.md).")
    name: str | None = Field(None, description="Custom node: the class in `module`.")
    depends: list[str] = Field(default_factory=list, description="Custom node: the nodes whose outputs it takes.")
    profile: ProfileConfig | None = Field(None, description="FlagScale per-node default of action=bench.")
    routing: RoutingPolicy | None = Field(
        None,
        description="Engine node: how the router picks a replica per request (docs/routing.md). cache_aware "
        "(default): the replica that was sent the longest prefix of the prompt (chat: of the conversation), within "
        "a load bound; least_load: the least busy; session: sticky per OpenAI `user` field or X-Session-Id "
        "header, else least_load; round_robin: in turn.",
    )
    routing_options: RoutingOptions = Field(
        default_factory=RoutingOptions,
        description="Engine node: settings of its `routing` policy, each key one the policy has: see below.",
    )
    disaggregation: Disaggregation | None = Field(
        None,
        description="Engine node: serve it as a prefill pool and a decode pool (docs/disaggregation.md); "
        "deploy.prefill_decode_disaggregation gives every engine node one.",
    )

    @field_validator("serve_id")
    @classmethod
    def _safe_serve_id(cls, serve_id: str) -> str:
        if not SAFE_ID.fullmatch(serve_id):
            raise ValueError(
                f"serve_id {serve_id!r} is not a safe name: use letters, digits, '.', '_' and '-', starting with a "
                "letter or digit (it names log files and Ray Serve deployments)"
            )
        return serve_id

    @model_validator(mode="after")
    def _kind(self) -> NodeConfig:
        if self.engine is not None and self.module is not None:
            raise ValueError("a node is either an engine node (`engine`) or a custom node (`module`), not both")
        if self.module is not None and self.disaggregation is not None:
            raise ValueError("`disaggregation` is for engine nodes; a custom node has no prefill or decode")
        if self.engine is not None and self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; known: {', '.join(ENGINES)}")
        if self.module is not None and self.allow_engine_args:
            raise ValueError("`allow_engine_args` is for engine nodes; a custom node has no engine args")
        if self.module is not None and self.lora is not None:
            raise ValueError("`lora` is for engine nodes; a custom node serves no adapters")
        if self.disaggregation is not None and self.lora is not None:
            raise ValueError("`lora` with `disaggregation`: adapters are served by colocated engine nodes only")
        if self.module is not None and self.routing is not None:
            raise ValueError("`routing` is for engine nodes; a custom node is called by the graph, not routed")
        if self.module is not None and self.resources.slo is not None:
            raise ValueError(
                "`resources.slo` is for engine nodes (their engines measure the latency); a custom node "
                "autoscales on Serve's request count"
            )
        if self.module is not None and not self.name:
            raise ValueError("a custom node with `module` also needs `name` (the class)")
        if self.module is None:
            check_routing_options(self.routing, self.routing_options)
        unknown = sorted(set(self.engine_args_specific) - set(ENGINES))
        if unknown:
            raise ValueError(f"engine_args_specific has unknown engine(s) {unknown}; known: {', '.join(ENGINES)}")
        return self

    def merged_engine_args(self) -> dict[str, Any]:
        """engine_args with engine_args_specific.<engine> over them."""
        return {**self.engine_args, **self.engine_args_specific.get(self.engine or "", {})}

    @property
    def is_engine(self) -> bool:
        return self.module is None
