"""What every action is handed: the loaded config, where it came from, the exp_dir, the console, how the user
called us, and the key."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from rich.console import Console

from flagscale.actions.invocation import RUN_PY, Invocation
from flagscale.config.load import ConfigSources, resolve_api_key
from flagscale.config.schema import ServeConfig
from flagscale.plan import Plan, build_plan
from flagscale.update import snapshot

KEY_VALUE_NOTICE = (
    "experiment.runner.deploy.api_key gives the key itself: on a command line it shows in `ps` (and in a Ray "
    "job's entrypoint), in YAML it sits in a file; prefer api_key_env: <the name of an env var holding the key>"
)


@dataclass
class ActionContext:
    config: ServeConfig
    sources: ConfigSources
    exp_dir: str
    console: Console
    invocation: Invocation = RUN_PY  # how the user called us: what to type next is said in that form

    @property
    def action(self) -> str:
        return self.config.action

    @cached_property
    def api_key(self) -> str | None:
        """The key clients send (resolved once per action); an unset api_key_env is one clear error."""
        return resolve_api_key(self.config, self.sources)

    def print_notices(self) -> None:
        """What loading mapped or ignored: printed by the actions that plan."""
        for notice in self.config.notices:
            self.console.print(f"[yellow]notice:[/] {notice}", soft_wrap=True)
        if self.config.experiment.runner.deploy.api_key is not None:
            self.console.print(
                f"[yellow]notice:[/] {KEY_VALUE_NOTICE}",
                soft_wrap=True,
            )

    def plan(self, check_port: bool = True, quiet: bool = False) -> Plan:
        """The plan of this config (check_port=False: the port is a running deployment's own)."""
        if quiet:
            return build_plan(self.config, self.sources, check_port=check_port)
        with self.console.status("validating the config ..."):
            return build_plan(self.config, self.sources, check_port=check_port)

    def snapshot(self, plan: Plan) -> dict:
        """The config as the state file records it (secrets masked), for updates in place."""
        return snapshot(self.config, plan.api_key, plan.graph)
