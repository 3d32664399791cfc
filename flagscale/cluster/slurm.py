"""`runner.hostfile: slurm`: the hosts of the Slurm allocation this runs in, as a hostfile.

Inside `salloc` or an `sbatch` job script, Slurm describes the allocation in the environment: the nodes
(`SLURM_JOB_NODELIST`, in Slurm's compressed hostlist form such as `gpu[01-04,07],login1`), the CPUs each node
gives the job (`SLURM_JOB_CPUS_PER_NODE`, e.g. `72(x2),36`) and the GPUs per node (`SLURM_GPUS_PER_NODE`, e.g.
`a100:4` or `4`, else `SLURM_GPUS_ON_NODE` / `SLURM_JOB_GPUS` of the batch node). From there the run goes the SSH
way, as with a hostfile: the first node (the one the job script runs on) is the head unless `runner.head` names
another. Nodes with GPUs are GPU hosts (typed by the GRES type when it is a GPU model the hostfile knows, such as
a100 or h100); an allocation without GPUs gives CPU hosts (`type=cpu`, one slot per allocated CPU). Each Ray node
declares the CPUs the job has on the fewest-CPU node (unless runner.num_cpus says otherwise), not the whole
machine's.

A source of hosts beside the hostfile (hostfile.py), read by the SSH launcher (launchers/ssh.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from flagscale import devices
from flagscale.cluster.hostfile import HostEntry, Hostfile, pick_head
from flagscale.errors import ConfigError

KEYWORD = "slurm"  # the value of runner.hostfile that means "this Slurm allocation"
NODELIST = "SLURM_JOB_NODELIST"
CPUS_PER_NODE = "SLURM_JOB_CPUS_PER_NODE"

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_REPEAT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]*$")


def expand_hostlist(hostlist: str, where: str = NODELIST) -> list[str]:
    """Slurm's compressed hostlist -> host names in order: `n[01-03,7],x` -> n01 n02 n03 n7 x. Zero padding is kept;
    several bracket groups in one name (`r[1-2]n[1-2]`) expand as a product, left to right."""
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip(), where):
        hosts.extend(_expand_item(item, where))
    if not hosts:
        raise ConfigError(f"no host in {hostlist!r}", where)
    return hosts


def _split_top_level(text: str, where: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"unbalanced ']' in {text!r}", where)
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"unbalanced '[' in {text!r}", where)
    items.append(text[start:])
    return [item for item in (i.strip() for i in items) if item]


def _expand_item(item: str, where: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    numbers: list[str] = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise ConfigError(f"bad range {part!r} in {item!r}", where)
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ConfigError(f"range {part!r} in {item!r} runs backwards", where)
        width = len(first)
        numbers += [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
    return [prefix + number + tail for number in numbers for tail in _expand_item(rest, where)]


def expand_counts(value: str, count: int, where: str) -> list[int]:
    """SLURM_JOB_CPUS_PER_NODE's `72(x2),36` -> [72, 72, 36], checked against the number of nodes."""
    counts: list[int] = []
    for part in value.split(","):
        match = _REPEAT.match(part.strip())
        if not match:
            raise ConfigError(f"expected counts like `72(x2),36`, got {value!r}", where)
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(counts) != count:
        raise ConfigError(f"{value!r} gives {len(counts)} node(s), but {NODELIST} lists {count}", where)
    return counts


def gpus_per_node(env: Mapping[str, str]) -> tuple[int, str | None]:
    """(GPUs on each node, their GRES type or None) from the job's environment; (0, None) when it has none."""
    value = env.get("SLURM_GPUS_PER_NODE", "").strip()
    if value:
        *names, count = value.split(":")
        if names[:1] == ["gpu"]:  # the GRES name itself: gpu:4, gpu:a100:4
            names = names[1:]
        if not count.isdigit() or len(names) > 1 or not all(_NAME.match(n) for n in names):
            raise ConfigError(f"expected a GPU count such as `4` or `a100:4`, got {value!r}", "SLURM_GPUS_PER_NODE")
        return int(count), (names[0] if names else None)
    on_node = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if on_node:
        if not on_node.isdigit():
            raise ConfigError(f"expected a number, got {on_node!r}", "SLURM_GPUS_ON_NODE")
        return int(on_node), None
    job_gpus = env.get("SLURM_JOB_GPUS", "").strip()
    return (len(job_gpus.split(",")), None) if job_gpus else (0, None)


def allocation_hostfile(env: Mapping[str, str], head: str | None, where_head: str) -> Hostfile:
    """The allocation's nodes as a Hostfile (num_cpus: the fewest CPUs any node gives the job)."""
    nodelist = env.get(NODELIST, "").strip()
    if not nodelist:
        raise ConfigError(
            f"runner.hostfile is 'slurm', but {NODELIST} is not set: run inside a Slurm allocation (salloc, or an "
            "sbatch job script), or give a hostfile",
            "experiment.runner.hostfile",
        )
    hosts = expand_hostlist(nodelist)
    duplicates = sorted({h for h in hosts if hosts.count(h) > 1})
    if duplicates:
        raise ConfigError(f"{', '.join(duplicates)} listed more than once in {nodelist!r}", NODELIST)
    cpus = expand_counts(env[CPUS_PER_NODE], len(hosts), CPUS_PER_NODE) if env.get(CPUS_PER_NODE) else None
    gpus, gres_type = gpus_per_node(env)
    entries = []
    for line, host in enumerate(hosts, start=1):
        if gpus:  # a GRES type that names no GPU family's chip is left out (the host is then NVIDIA's, untyped)
            family = devices.chip_family(gres_type) if gres_type else None
            chip = gres_type if family and family[0].gpu_spelling else None
            entries.append(HostEntry(host=host, slots=gpus, chip=chip, line=line))
        elif cpus:
            entries.append(HostEntry(host=host, slots=cpus[line - 1], chip="cpu", line=line))
        else:
            raise ConfigError(
                f"the allocation has neither GPUs (SLURM_GPUS_PER_NODE) nor {CPUS_PER_NODE}: cannot tell what "
                "each node offers",
                NODELIST,
            )
    head_entry = pick_head(entries, head, where_head, "a node of the allocation")
    job = env.get("SLURM_JOB_ID", "?")
    return Hostfile(
        path=f"slurm job {job}: {nodelist}",
        hosts=entries,
        head=head_entry,
        num_cpus=min(cpus) if cpus else None,
    )
