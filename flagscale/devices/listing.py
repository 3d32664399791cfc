"""Vendor CLI listings -> Devices. Each parser is pure (text in, devices out) and keeps what it cannot read out
rather than guessing; the families name which one reads their CLI."""

from __future__ import annotations

import json
import re

from flagscale.devices.base import Device

_USED_TOTAL = re.compile(r"(\d+)\s*/\s*(\d+)")
_MIB = re.compile(r"(\d+)\s*/\s*(\d+)\s*MiB", re.IGNORECASE)


def nvidia_smi_csv(out: str) -> list[Device]:
    """`nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,nounits`."""
    devices = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit() and parts[3].isdigit():
            devices.append(Device(int(parts[0]), parts[2], int(parts[3]), parts[1]))
    return devices


def npu_smi_info(out: str) -> list[Device]:
    """`npu-smi info`: a table of two rows per NPU chip, `| <npu> <name> | <health> | ...` then
    `| <chip> | <bus-id> | ... <hbm used> / <hbm total> |`; the memory is the last `used / total` of the second."""
    devices = []
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines() if line.startswith("|")
    ]
    for first, second in zip(rows, rows[1:]):
        head = first[0].split()
        pairs = _USED_TOTAL.findall(second[-1])
        if len(head) < 2 or not head[0].isdigit() or not second[0].isdigit() or not pairs:
            continue
        devices.append(Device(int(head[0]), " ".join(head[1:]), int(pairs[-1][1])))
    return devices


def rocm_smi_json(out: str) -> list[Device]:
    """`rocm-smi --showproductname --showmeminfo vram --json`: {"card<N>": {"Card Series": ..., "VRAM Total
    Memory (B)": ...}}."""
    try:
        cards = json.loads(out)
    except ValueError:
        return []
    devices = []
    for key, card in cards.items() if isinstance(cards, dict) else ():
        index = key.removeprefix("card")
        total = next((v for k, v in card.items() if k.lower().startswith("vram total memory")), None)
        if not index.isdigit() or not isinstance(card, dict):
            continue
        name = next((str(v) for k, v in card.items() if k.lower() in ("card series", "card model")), "")
        memory = int(total) // 2**20 if str(total).isdigit() else None
        devices.append(Device(int(index), name, memory))
    return sorted(devices, key=lambda d: d.index)


def smi_table(out: str) -> list[Device]:
    """An nvidia-smi-like table (mx-smi): a row `| <index> <name> ... |` opens a device, the next `<used>/<total>
    MiB` on or after it is its memory."""
    devices: list[Device] = []
    current: tuple[int, str] | None = None
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        head = cells[0].split() if cells else []
        if len(head) >= 2 and head[0].isdigit() and not head[1][0].isdigit():
            current = (int(head[0]), head[1])
        match = _MIB.search(line)
        if current and match:
            devices.append(Device(current[0], current[1], int(match.group(2))))
            current = None
    return devices
