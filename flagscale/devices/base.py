"""What a device family is: everything the orchestrator needs to know about one kind of chip, declared in one
module of this folder (flagscale/devices/<name>.py defines `FAMILY = DeviceFamily(...)`; the registry is
flagscale/devices/__init__.py).

Ray already knows the chips (ray/_private/accelerators/: its managers name each chip's Ray resource and set each
worker's visible-devices variable from what Ray assigned it). A family names its Ray manager and agrees with it;
what Ray gives no figure for (device memory) comes from the vendor's CLI, whose output the family parses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from flagscale.adaptors import ray, ray_accelerators


@dataclass(frozen=True)
class Device:
    """One device as the vendor's CLI lists it."""

    index: int
    name: str
    memory_mib: int | None  # total memory; None: the listing gave no figure
    uuid: str = ""


@dataclass(frozen=True)
class EngineOnFamily:
    """How one engine kind runs on a family: built in, or through a plugin (its pip package, and the env that
    enables it in every engine process, e.g. VLLM_PLUGINS)."""

    how: str  # one line for docs and errors: "vLLM's platform plugin vllm-ascend"
    package: str | None = None  # the pip package that brings it (None: the engine's own build)
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Collective:
    """The collective library the family's ranks talk through, and the variables that name its network interface
    when ranks span hosts."""

    library: str  # NCCL, RCCL, HCCL, MCCL, gloo
    interface_env: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceFamily:
    name: str  # the registry key, and a hostfile `type=` that names it
    title: str  # "Ascend NPU"
    ray_resource: str | None  # Ray's resource for one device ("GPU", "NPU"); None: CPU cores
    ray_manager: str | None  # the class name of Ray's accelerator manager for it (ray._private.accelerators)
    visible_env: str | None  # the variable that limits a process to its devices (Ray sets it from its assignment)
    chip_types: frozenset[str] = frozenset()  # other hostfile `type=` values (lowercase) that mean this family
    list_argv: tuple[str, ...] = ()  # the vendor CLI listing the devices and their memory
    parse_listing: Callable[[str], list[Device]] | None = None
    collective: Collective = Collective("gloo")
    # engine kind -> how it runs here; a kind missing is refused on this family before anything starts
    engines: Mapping[str, EngineOnFamily] = field(default_factory=dict)
    # other ways to run an engine kind here (vllm-plugin-FL): chosen by setting their env in experiment.envs
    alternatives: Mapping[str, tuple[EngineOnFamily, ...]] = field(default_factory=dict)
    # what must hold in every process of a host with more than one device of this family
    multi_device_env: Mapping[str, str] = field(default_factory=dict)
    # the KV connectors its prefill/decode engines can move caches with (a disaggregated node across families
    # needs one both sides have)
    kv_connectors: frozenset[str] = frozenset()

    @property
    def on_cpu(self) -> bool:
        return self.ray_resource is None

    @property
    def gpu_spelling(self) -> bool:
        """Whether its devices are Ray's `GPU` (num_gpus, `ray start --num-gpus`), as NVIDIA, AMD and MetaX are."""
        return self.ray_resource == "GPU"

    def matches(self, chip_type: str) -> bool:
        return chip_type.lower() == self.name or chip_type.lower() in self.chip_types

    def ray_start_resources(self, slots: int) -> tuple[int | None, dict[str, float]]:
        """(--num-gpus, custom --resources) a host with `slots` devices of this family starts its Ray node with."""
        if self.gpu_spelling:
            return slots, {}
        if self.ray_resource is None:
            return None, {}
        return None, {self.ray_resource: float(slots)}

    def process_env(self, devices_on_host: int) -> dict[str, str]:
        """What every Ray process on a host with `devices_on_host` devices of this family must have."""
        return dict(self.multi_device_env) if devices_on_host > 1 else {}

    def visible(self, device_ids: list[str] | tuple[str, ...]) -> dict[str, str]:
        """The visible-devices variable for a process limited to `device_ids` (as Ray assigned them)."""
        if not self.visible_env or not device_ids:
            return {}
        return {self.visible_env: ",".join(device_ids)}

    def engine_env(self, engine: str, user_env: Mapping[str, str]) -> dict[str, str]:
        """The env that runs `engine` here: its declared plugin's, unless the user's envs choose (VLLM_PLUGINS set
        there picks an alternative such as vllm-plugin-FL)."""
        support = self.engines.get(engine)
        if support is None:
            return {}
        return {k: v for k, v in support.env.items() if k not in user_env}

    def list_devices(self, run: Callable[[list[str]], str | None]) -> list[Device] | None:
        """The devices the vendor CLI lists, `run` running it (here or on a host); None: no CLI or no answer."""
        if not self.list_argv or self.parse_listing is None:
            return None
        out = run(list(self.list_argv))
        return None if out is None else self.parse_listing(out)

    def assigned_ids(self) -> list[str]:
        """The devices of this family Ray assigned the calling worker or actor ([] for CPUs, or outside Ray)."""
        if self.ray_resource is None:
            return []
        return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get(self.ray_resource, [])]

    def ray_manager_class(self):
        """Ray's accelerator manager for the family (imported on first use: Ray is heavy)."""
        return None if self.ray_manager is None else getattr(ray_accelerators, self.ray_manager)
