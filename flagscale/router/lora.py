"""The router's LoRA adapters (docs/routing.md): each adapter a model of its node (RouterSpec.adapters), routed by
its node's policy wrapped in the node's shared adapter placement (policies/adapters.py), and its loads and evictions
in /metrics."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from flagscale.config.routing import RoutingSpec
from flagscale.router.policies import Policy, make_policy
from flagscale.router.policies.adapters import AdapterAware, Placement
from flagscale.router.spec import RouterSpec


class AdapterRouting:
    """One Placement per node with adapters (by serve_id), shared by its adapters' policies."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.placements: dict[str, Placement] = {}
        if registry is not None:
            registry.register(_PlacementCollector(self))

    def policy(self, model: str, spec: RouterSpec) -> Policy:
        """`model`'s policy: its node's routing, placed by the node's adapters when `model` is an adapter."""
        policy = make_policy(spec.routing.get(model, RoutingSpec()))
        if model not in spec.adapters:
            return policy
        serve_id = spec.models[model]
        max_loras = spec.max_loras.get(serve_id, 1)
        placement = self.placements.setdefault(serve_id, Placement(max_loras))
        placement.max_loras = max_loras  # an update may change it
        return AdapterAware(model, policy, placement)


class _PlacementCollector:
    """flagscale_router_adapter_loads_total / _evictions_total{model}: an adapter sent to a replica that did not
    hold it (its engine swaps it in), and pushed out of a replica's max_loras by another (as the router counts)."""

    def __init__(self, routing: AdapterRouting) -> None:
        self._routing = routing

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        loads = CounterMetricFamily(
            "flagscale_router_adapter_loads",
            "LoRA adapter requests sent to a replica not holding the adapter (it swaps the adapter in).",
            labels=["model"],
        )
        evictions = CounterMetricFamily(
            "flagscale_router_adapter_evictions",
            "LoRA adapters pushed out of a replica's max_loras by another adapter's request.",
            labels=["model"],
        )
        for placement in list(self._routing.placements.values()):
            for adapter, count in sorted(placement.loads.items()):
                loads.add_metric([adapter], count)
            for adapter, count in sorted(placement.evictions.items()):
                evictions.add_metric([adapter], count)
        yield loads
        yield evictions
