"""The FlagScale hostfile: one host per line, `<ip-or-hostname> slots=<N> [type=<chip>]`.

`#` starts a comment; blank lines are ignored. The first host is the Ray head unless `runner.head`
names another one (pick_head, shared with a Slurm allocation's hosts: cluster/slurm.py). Every mistake is reported
with the file and line, before anything is started.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from flagscale.errors import ConfigError

# Chip types whose slots are GPUs to Ray (`--num-gpus`); any other type is a custom resource.
GPU_TYPES = frozenset({"gpu", "nvidia", "cuda", "a100", "h100", "h800", "a800", "l40s"})
HEAD_RESOURCE = "flagscale_head"

_HOST = re.compile(r"^[A-Za-z0-9_.:\-\[\]]+$")
_TYPE = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class HostEntry:
    host: str
    slots: int
    chip: str | None
    line: int

    @property
    def is_gpu(self) -> bool:
        return self.chip is None or self.chip.lower() in GPU_TYPES

    def ray_resources(self, is_head: bool) -> tuple[int | None, dict[str, float]]:
        """(num_gpus, custom resources) this host's `ray start` declares."""
        resources: dict[str, float] = {}
        num_gpus = None
        if self.is_gpu:
            num_gpus = self.slots
        else:
            resources[self.chip] = float(self.slots)
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

    def by_chip(self) -> dict[str | None, list[HostEntry]]:
        groups: dict[str | None, list[HostEntry]] = {}
        for entry in self.hosts:
            groups.setdefault(entry.chip, []).append(entry)
        return groups


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
        raise ConfigError(f"type must be a chip name (letters, digits, _ . -), got {chip!r}", where)
    return HostEntry(host=host, slots=int(slots), chip=chip, line=number)
