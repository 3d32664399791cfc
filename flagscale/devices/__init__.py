"""Device families, one module each, behind one declaration (flagscale/devices/base.py: DeviceFamily).

A new family is a module here that defines `FAMILY = DeviceFamily(...)` and a line in FAMILIES (docs/chips.md says
what to fill in). A hostfile's `type=` names a family: its name, one of its chip types (FlagScale's `type=A100`,
`type=gpu`), or `<family>:<model>`; `chip_family` reads it. listing.py: the vendor CLIs' listings, parsed.

A basic floor: it imports nothing of the project above it (Ray's accelerator managers through flagscale/adaptors).
The names before families (Gpu, local_gpus, visible, local_gpu_count: NVIDIA's) are kept here for their callers.
"""

from __future__ import annotations

import importlib

from flagscale.devices.base import Collective, Device, DeviceFamily, EngineOnFamily
from flagscale.devices.nvidia import Gpu, local_gpu_count, local_gpus, visible

# config spelling -> the module that declares it
FAMILIES = {
    "cpu": "flagscale.devices.cpu",
    "nvidia": "flagscale.devices.nvidia",
    "ascend": "flagscale.devices.ascend",
    "amd": "flagscale.devices.amd",
    "metax": "flagscale.devices.metax",
}
DEFAULT_FAMILY = "nvidia"  # a hostfile host without type= (FlagScale's GPU hosts)

__all__ = [
    "DEFAULT_FAMILY",
    "FAMILIES",
    "Collective",
    "Device",
    "DeviceFamily",
    "EngineOnFamily",
    "Gpu",
    "all_families",
    "chip_family",
    "get",
    "local_gpu_count",
    "local_gpus",
    "visible",
]


def get(name: str) -> DeviceFamily:
    return importlib.import_module(FAMILIES[name]).FAMILY


def all_families() -> list[DeviceFamily]:
    return [get(name) for name in FAMILIES]


def chip_family(chip_type: str) -> tuple[DeviceFamily, str | None] | None:
    """(family, model of chip) a hostfile `type=` names, or None when it names none: a family's name (no model),
    one of its chip types (`A100`: that model; `gpu`, `npu`: none), or `<family>:<model>`."""
    family_name, sep, model = chip_type.partition(":")
    if sep:
        return (get(family_name.lower()), model or None) if family_name.lower() in FAMILIES and model else None
    for family in all_families():
        if chip_type.lower() == family.name:
            return family, None
        if chip_type.lower() in family.chip_types:
            generic = chip_type.lower() in ("gpu", "cuda", "npu", "rocm", "maca", "huawei")
            return family, None if generic else chip_type
    return None


def known_types() -> str:
    """The `type=` values understood, for errors."""
    names = ", ".join(FAMILIES)
    return f"a family ({names}), a chip of one (A100, H100, 910B, MI300X, C500, ...), or <family>:<model>"
