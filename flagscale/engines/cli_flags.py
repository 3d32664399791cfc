"""An engine server's argv read back as flags: what the engine's own parser would see of the options it was given."""

from __future__ import annotations


def flags_of(argv: list[str]) -> dict[str, str | bool]:
    """`--flag value` / `--flag=value` / `--switch` of an argv, the last one winning."""
    flags: dict[str, str | bool] = {}
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg.partition("=")
        if eq:
            flags[name] = value
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            flags[name] = argv[i + 1]
        else:
            flags[name] = True
    return flags
