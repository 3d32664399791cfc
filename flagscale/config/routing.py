"""A node's routing as planned: which policy picks its replicas and the policy's settings, and the router's bounds
on what it takes in. The policies and their settings types are in flagscale/router/policies/; this is what the
plan hands them (docs/routing.md)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from flagscale.config.schema import DeployConfig, NodeConfig
from flagscale.router.policies import DEFAULT_POLICY, Settings, policy_type

_DEPLOY = {name: field.default for name, field in DeployConfig.model_fields.items()}
# Requests one engine replica is sent at once when its node sets no resources.max_ongoing_requests: far above
# vLLM's max_num_seqs (256 by default), so the engine's own scheduler does the queueing and throughput is never
# capped by the router; the router's queue only takes over past it.
DEFAULT_MAX_ONGOING_REQUESTS = 1000


@dataclass(frozen=True)
class RoutingSpec:
    """One engine node's routing, as planned (flagscale/plan/) and given to the router per model: the policy and
    its settings, of the policy's own settings type (plain dataclasses, so the router's Serve user_config stays
    JSON: from_json reads asdict's form back)."""

    policy: str = DEFAULT_POLICY
    settings: Settings = None  # type: ignore[assignment]  # None: the policy's defaults

    def __post_init__(self) -> None:
        kind = policy_type(self.policy)
        if self.settings is None:
            object.__setattr__(self, "settings", kind.settings_type())
        elif type(self.settings) is not kind.settings_type:
            raise TypeError(f"routing {self.policy} takes {kind.settings_type.__name__}, not {self.settings!r}")

    @classmethod
    def of(cls, policy: str | None = None, **settings: Any) -> RoutingSpec:
        """`policy` (None: the default) with these of its settings (a setting it does not have: TypeError)."""
        kind = policy_type(policy or DEFAULT_POLICY)
        return cls(kind.name, kind.settings_type(**settings))

    @classmethod
    def of_node(cls, node: NodeConfig) -> RoutingSpec:
        """An engine node's `routing` with its `routing_options` (the schema checked they are its policy's). A
        disaggregated node's prefill pool with a policy of its own (disaggregation.prefill_routing) takes those of
        the node's options its policy has too."""
        kind = policy_type(node.routing or DEFAULT_POLICY)
        own = kind.settings_type.names()
        return cls.of(kind.name, **{k: v for k, v in node.routing_options.model_dump().items() if k in own})

    @classmethod
    def from_json(cls, spec: dict[str, Any]) -> RoutingSpec:
        return cls.of(spec["policy"], **spec.get("settings", {}))


@dataclass(frozen=True)
class Admission:
    """The router's bounds on what it takes in (deploy settings, docs/routing.md#admission-control)."""

    max_body_bytes: int = _DEPLOY["max_body_bytes"]
    max_queued_requests: int = _DEPLOY["max_queued_requests"]
    queue_timeout_s: float = _DEPLOY["queue_timeout_s"]
    upstream_first_byte_timeout_s: float = _DEPLOY["upstream_first_byte_timeout_s"]
    upstream_idle_timeout_s: float = _DEPLOY["upstream_idle_timeout_s"]
    client_idle_timeout_s: float = _DEPLOY["client_idle_timeout_s"]
    client_body_timeout_s: float = _DEPLOY["client_body_timeout_s"]
    max_client_connections: int = _DEPLOY["max_client_connections"]
    max_reading_body_bytes: int = _DEPLOY["max_reading_body_bytes"]
    allowed_hosts: tuple[str, ...] = ()

    @classmethod
    def of(cls, deploy: DeployConfig) -> Admission:
        bounds = {bound.name: getattr(deploy, bound.name) for bound in fields(cls)}
        return cls(**bounds | {"allowed_hosts": tuple(deploy.allowed_hosts)})
