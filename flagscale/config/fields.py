"""What every part of the schema is built from: strict models, FlagScale's accepted-and-ignored keys, engine
names, safe ids."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from flagscale import engines

ENGINES = tuple(engines.ENGINES)  # every engine a node may name (flagscale/engines/)
# task.backend: an engine, or `native` (a graph of custom nodes); the names come from the engine registry
Backend = Literal[(*ENGINES, "native")]  # type: ignore[valid-type]

# A node id names files and Serve deployments: no path separators, no `..`, nothing a shell or URL treats specially.
SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def launcher_key(default: Any, why: str, **kwargs: Any) -> Any:
    """A FlagScale key that configures FlagScale's own launcher and has no meaning here: typed (a wrong value is
    still an error), accepted, and listed by `run`/`dryrun` with `why` (flagscale/config/compat.py)."""
    return Field(
        default,
        description=f"FlagScale key, accepted and ignored: {why}.",
        json_schema_extra={"ignored_because": why},
        **kwargs,
    )
