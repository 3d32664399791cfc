"""The client keys of an in-place update (flagscale/router/keyring.py): which key the router accepts while the
update runs and after it (docs/operations.md, "Rotating the key").

While the update runs, the router accepts the new key and the keys it accepted before, those until the update's
own bound at the latest (startup_timeout_s, then old_key_grace_s). Once the update is done (every deployment
serves the new config), the keys the new one replaced get their end: old_key_grace_s from then. Both steps reach
the running router processes in place, through Serve's user_config: no router process is restarted and no engine
replaced for a key. A client that takes the new key once `run` has said `updated` is never refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console

from flagscale.cluster.ray_compat import serve_details
from flagscale.plan import ROUTER_DEPLOYMENT, Plan
from flagscale.router import keyring, peers
from flagscale.router.keyring import AcceptedKey

Keys = tuple[AcceptedKey, ...]
# beyond startup_timeout_s: the update's steps before its wait for the new config begins (the deploy itself)
UPDATE_MARGIN_S = 60.0


def running_keys(app: str) -> Keys:
    """The keys the deployment's router processes accept now, as Serve holds their user_config; () when it has
    none (a router without a key, or one deployed before client_keys existed)."""
    details = serve_details().applications.get(app)
    router = details.deployments.get(ROUTER_DEPLOYMENT) if details else None
    config = (router.deployment_config.user_config if router else None) or {}
    return keyring.keys_from_json(config.get("client_keys", ()))


def _new_digest(plan: Plan) -> str | None:
    return keyring.client_digest(peers.secret_of(plan.exp_dir), plan.api_key) if plan.api_key else None


def during_update(plan: Plan, running: Keys, now: float) -> Keys:
    """What the router accepts while the update runs: the plan's key, and the running keys until the update's
    bound (after which `run` has given up, and the old key would otherwise never end)."""
    bound = plan.startup_timeout_s + UPDATE_MARGIN_S + plan.old_key_grace_s
    return keyring.rotated(running, _new_digest(plan), now, now + bound)


def after_update(plan: Plan, during: Keys, now: float) -> Keys:
    """What the router accepts once the update is done: the replaced keys until old_key_grace_s from `now`."""
    return keyring.rotated(during, _new_digest(plan), now, now + plan.old_key_grace_s)


def finish(plan: Plan, during: Keys, redeploy: Callable[[Keys], None], console: Console) -> Keys:
    """The update is done: the replaced keys, if any, are given their end (`redeploy` hands the router the keys
    and waits until it has them), and `run` says until when the old key works. An old_key_grace_s lowered by this
    update shortens the grace of a key replaced before (0: refused now)."""
    final = after_update(plan, during, time.time())
    if final == during:
        return during
    redeploy(final)
    ends = [k.until for k in final if k.until is not None]
    until = f"until {time.strftime('%H:%M:%S', time.localtime(max(ends)))}" if ends else "no longer"
    console.print(
        f"API key: the new key works now; the key(s) it replaced {until} (deploy.old_key_grace_s="
        f"{plan.old_key_grace_s:g})"
    )
    return final
