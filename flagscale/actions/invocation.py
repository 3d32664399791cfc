"""How the user called the runner, so that what to type next is said in the form they used: `flagscale serve demo
--status` after `flagscale serve demo`, `python run.py ... action=status` after `python run.py ...`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Invocation:
    base: str = "python run.py ..."  # the command line without its action
    # action -> how that command line asks for it; default `action=NAME` (Hydra's override)
    action_words: Mapping[str, str] = field(default_factory=dict)

    def command(self, action: str) -> str:
        """The command line that runs `action` on the same deployment."""
        return " ".join(filter(None, (self.base, self.action_words.get(action, f"action={action}"))))


RUN_PY = Invocation()
