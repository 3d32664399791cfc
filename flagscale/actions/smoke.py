"""`action=test` (FlagScale's name): make sure the deployment runs, send one completion per model, report.

A deployment already running for this exp_dir is tested as it is; otherwise `run` starts it first. It
stays up afterwards (action=stop ends it). Exit 0 only if every model answered.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from rich.console import Console
from rich.table import Table

from flagscale.actions.context import ActionContext
from flagscale.actions.run import refuse_if_running, run, running_state
from flagscale.cluster.state import RunState

PROMPT = "Hello, my name is"
TIMEOUT_S = 120


def complete_once(
    endpoint: str, model: str, timeout_s: float = TIMEOUT_S, api_key: str | None = None
) -> tuple[bool, str, float]:
    """(answered, generated text or the error, seconds) for one short completion."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(f"{endpoint}/v1/completions", body, headers)
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            text = json.loads(resp.read())["choices"][0]["text"]
            return True, text, time.monotonic() - start
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:200]}", time.monotonic() - start
    except (OSError, ValueError, KeyError, IndexError) as exc:
        return False, f"{type(exc).__name__}: {exc}", time.monotonic() - start


def smoke_test(state: RunState, console: Console, api_key: str | None = None) -> int:
    table = Table(title=f"test: one completion per model at {state.endpoint}", title_justify="left")
    for column in ("model", "answered", "seconds", "text / error"):
        table.add_column(column)
    failed = 0
    for model in state.models:
        ok, text, seconds = complete_once(state.endpoint, model, api_key=api_key)
        failed += not ok
        table.add_row(model, "[green]yes[/]" if ok else "[red]no[/]", f"{seconds:.2f}", repr(text) if ok else text)
    if state.models:
        console.print(table)
    else:
        console.print("no engine models to test (a graph of custom nodes only)")
    console.print(
        f"{len(state.models) - failed}/{len(state.models)} model(s) answered; still serving (action=stop stops it)"
    )
    return 1 if failed else 0


def act(ctx: ActionContext) -> int:
    ctx.print_notices()
    if running_state(ctx.exp_dir) is None:
        refuse_if_running(ctx.exp_dir, ctx.console, ctx.config.experiment.env_for)
        plan = ctx.plan()
        code = run(plan, ctx.console, snapshot=ctx.snapshot(plan))
        if code != 0:
            return code
    state = RunState.load(ctx.exp_dir)
    assert state is not None
    return smoke_test(state, ctx.console, ctx.api_key)
