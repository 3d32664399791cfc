"""The FlagScale hostfile: one host per line, `<ip-or-hostname> slots=<N> [type=<chip>]`.

`type=` names the host's device family (flagscale/devices: `gpu`, `A100`, `ascend`, `910B`, `cpu`, `cpu:<model>`,
...); a host without one has NVIDIA GPUs, as in FlagScale. A type that names no family is refused at its line.

`#` starts a comment; blank lines are ignored. The first host is the Ray head unless `runner.head`
names another one (pick_head, shared with a Slurm allocation's hosts: cluster/slurm.py). Every mistake is reported
with the file and line, before anything is started.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from flagscale import devices
from flagscale.devices import DeviceFamily
from flagscale.errors import ConfigError

HEAD_RESOURCE = "flagscale_head"

_HOST = re.compile(r"^[A-Za-z0-9_.:\-\[\]]+$")
_TYPE = re.compile(r"^[A-Za-z0-9_.\-]+(:[A-Za-z0-9_.\-]+)?$")


@dataclass(frozen=True)
class HostEntry:
    host: str
    slots: int
    chip: str | None
    line: int

    @property
    def family(self) -> DeviceFamily:
        """The device family its type= names (checked when the file was read); no type: NVIDIA."""
        found = devices.chip_family(self.chip) if self.chip else None
        return found[0] if found else devices.get(devices.DEFAULT_FAMILY)

    @property
    def model(self) -> str | None:
        """The model of chip its type= names (`A100`, `cpu:<model>`'s model), None for a bare family."""
        found = devices.chip_family(self.chip) if self.chip else None
        return found[1] if found else None

    @property
    def is_gpu(self) -> bool:
        return self.family.gpu_spelling

    @property
    def device_resource(self) -> str:
        """The Ray resource a replica reserves its devices of here: GPU, NPU, ...; a CPU host's slots are a custom
        resource named by its type."""
        return self.family.ray_resource or str(self.chip)

    def matches(self, selector: str) -> bool:
        """Whether resources.accelerator `selector` picks this host: its type as written, its family, its model."""
        return selector in (self.chip, self.family.name, self.model)

    def ray_resources(self, is_head: bool) -> tuple[int | None, dict[str, float]]:
        """(num_gpus, custom resources) this host's `ray start` declares."""
        num_gpus, resources = self.family.ray_start_resources(self.slots)
        if self.family.on_cpu:
            resources[self.device_resource] = float(self.slots)
        if self.chip:
            resources[f"accelerator_type:{self.chip}"] = 1.0
        if is_head:
            resources[HEAD_RESOURCE] = 1.0
        return num_gpus, resources


@dataclass(frozen=True)
class Hostfile:
    path: str
    hosts: list[HostEntry]
    head: HostEntry
    num_cpus: int | None = None  # CPUs each host gives the run, when the source says (a Slurm allocation)

    @property
    def workers(self) -> list[HostEntry]:
        return [h for h in self.hosts if h is not self.head]

    def matching(self, selector: str | None) -> list[HostEntry]:
        """The hosts resources.accelerator `selector` picks (None: every host)."""
        return [h for h in self.hosts if selector is None or h.matches(selector)]

    def by_chip(self) -> dict[str | None, list[HostEntry]]:
        groups: dict[str | None, list[HostEntry]] = {}
        for entry in self.hosts:
            groups.setdefault(entry.chip, []).append(entry)
        return groups


def host_env(config, entry: HostEntry) -> dict[str, str]:
    """A host's envs: what its family needs in every process (NVIDIA's multicast off on a multi-GPU host), then
    experiment.envs with device_type_specific for its family and type, and nodes_envs for it."""
    chip = (entry.family.name, entry.chip)
    return {**entry.family.process_env(entry.slots), **config.experiment.env_for(entry.host, chip)}


def parse_hostfile(path: str | Path, head: str | None = None, where_head: str = "experiment.runner.head") -> Hostfile:
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError("hostfile does not exist", str(path)) from None
    except OSError as exc:
        raise ConfigError(f"hostfile cannot be read: {exc.strerror}", str(path)) from None
    entries: list[HostEntry] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        entry = _parse_line(line, f"{path}:{number}", number)
        if entry.host in seen:
            raise ConfigError(f"duplicate host {entry.host!r} (also on line {seen[entry.host]})", f"{path}:{number}")
        seen[entry.host] = number
        if entries and (entries[0].chip is None) != (entry.chip is None):
            first = entries[0]
            raise ConfigError(
                f"host {entry.host!r} {'has no type' if entry.chip is None else f'has type={entry.chip}'}, but "
                f"{first.host!r} on line {first.line} {'has none' if first.chip is None else f'has type={first.chip}'}; "
                "give every host a type or none",
                f"{path}:{number}",
            )
        entries.append(entry)
    if not entries:
        raise ConfigError("hostfile lists no host (expected lines like `10.0.0.1 slots=8 type=gpu`)", str(path))
    return Hostfile(path=str(path), hosts=entries, head=pick_head(entries, head, where_head, f"a host of {path}"))


def pick_head(entries: list[HostEntry], head: str | None, where_head: str, among: str) -> HostEntry:
    """The Ray head: the host `head` names (runner.head), else the first; a ConfigError at `where_head` when
    `head` is none of `entries` (`among` says what they are: "a host of <path>")."""
    if head is None:
        return entries[0]
    for entry in entries:
        if entry.host == head:
            return entry
    raise ConfigError(f"head {head!r} is not {among} ({', '.join(e.host for e in entries)})", where_head)


def _parse_line(line: str, where: str, number: int) -> HostEntry:
    host, *fields = line.split()
    if "=" in host or not _HOST.match(host):
        raise ConfigError(f"expected `<host> slots=<N> [type=<chip>]`, got {line!r}", where)
    values: dict[str, str] = {}
    for item in fields:
        key, sep, value = item.partition("=")
        if not sep or key not in ("slots", "type") or not value:
            raise ConfigError(f"unexpected {item!r}; expected `<host> slots=<N> [type=<chip>]`", where)
        if key in values:
            raise ConfigError(f"{key}= is given twice", where)
        values[key] = value
    if "slots" not in values:
        raise ConfigError(f"host {host!r} has no slots=<N>", where)
    slots = values["slots"]
    if not slots.isdigit() or int(slots) < 1:
        raise ConfigError(f"slots must be a positive integer, got {slots!r}", where)
    chip = values.get("type")
    if chip is not None and not _TYPE.match(chip):
        raise ConfigError(f"type must be a chip name (letters, digits, _ . - and one :), got {chip!r}", where)
    if chip is not None and devices.chip_family(chip) is None:
        raise ConfigError(f"type={chip} names no device family; expected {devices.known_types()}", where)
    return HostEntry(host=host, slots=int(slots), chip=chip, line=number)
