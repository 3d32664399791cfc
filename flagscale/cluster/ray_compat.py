"""Every Ray API the project uses that Ray does not promise to keep: underscore names, `ray._raylet`, internal
module paths, and the wording of Serve messages we match. Nothing else in flagscale/ or benchmarks/ touches them.

Read from Ray 2.60.0 (the version in .venv). On a Ray bump, check this file against the new release - and only
this file. What each wraps, and why the public API does not do:

- deploy_app: `serve._run(app, _blocking=False, name=, route_prefix=None)`. The public `serve.run` calls `_run`
  with `_blocking=True` (it waits for RUNNING and raises on failure); `run` polls `serve.status()` itself to
  bound the wait and report each deployment's cause.
- with_version: `Deployment.options(version=..., _internal=True)`. Ray 2.60 removed `version` from the public
  options and gives imperatively deployed applications a random code version per deploy (every replica restarts
  on each redeploy); `_internal` is how Serve's own callers still set it.
- free_resources_per_node: `ray._private.state.available_resources_per_node()`, node id (hex) -> the resources
  not reserved now (`ray.available_resources()` sums them over the cluster).
- delete_app: `serve.delete(name, _blocking=False)`; `_blocking` is an underscore parameter of a public call.
  `stop` waits (bounded) on `serve.status()` itself.
- serve_details: `ray.serve.context._get_global_client().get_serve_details()` as `ServeInstanceDetails`: the
  deployment configs (num_replicas, autoscaling_config) and target replicas the dashboard's
  /api/serve/applications/ serves; the dashboard is off, so it is read from the controller. running_replicas
  reads a deployment's `required_resources` and its replicas' `node_id` and `state` from it.
- kv_put / kv_get / kv_del / kv_list: `ray.experimental.internal_kv._internal_kv_*`, the GCS key-value store
  (the replica registry, flagscale/replica/registry.py). Signatures: put(key, value, overwrite, *, namespace),
  get(key, *, namespace), del(key, *, namespace), list(prefix, *, namespace) -> list[bytes].
- connect_kv: `ray.experimental.internal_kv._initialize_internal_kv(ray._raylet.GcsClient(address=))`: the same
  key-value store for a process that is not a Ray driver (`logs` reads the replica registry so): a GCS client
  only, without a core worker, its threads or Python gRPC channels, and no ray.shutdown at exit.
- reload_ray_config: `ray._raylet.Config.initialize("")`, which re-reads the RAY_* env settings (RAY_AUTH_MODE)
  that Ray read at import, then `AuthenticationTokenLoader.instance().reset_cache()`, which drops a token read
  before; Ray's own test helpers do both, in this order, after setting them.
- ray_sets_no_sigterm_handler: `ray._private.utils.set_sigterm_handler`, which `ray.init` (ray/_private/worker.py)
  calls to install a SIGTERM handler that calls sys.exit, replaced by a no-op while a driver attaches.
- no_failure_signal_handler: `ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True`, the constant
  that `ray._raylet.CoreWorker` reads, when a driver connects, to decide `install_failure_signal_handler` (its env
  variable is read once, at import; the constant, so that no process started from here inherits it).
- node_ip_init_kwargs: `ray.init(_node_ip_address=...)`, which attaches a driver to the Ray node of that IP.
- check_gcs_auth: `ray._raylet.GcsClient(address=)`, which asks the GCS for the cluster id once: a refused token
  raises AuthenticationError at once, where `ray.init` retries it for ~20 s.
- node_logs_dir: `ray._private.worker.global_worker.node.get_logs_dir_path()`, the session log dir of the node a
  worker runs on (Ray's log API lists the files under it).
- RAY_CLI_MODULE: `ray.scripts.scripts`, the module behind the `ray` console script (its `main`).
- SERVE_WAITING_FOR_RESOURCES: Serve's deployment message for replicas that cannot be scheduled yet
  ("Deployment '<name>' in application '<app>' has N replicas that have taken more than <SLOW_STARTUP_WARNING_S>s
  to be scheduled. ...", ray/serve/_private/deployment_state.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from flagscale.adaptors import LazyImport, ray, serve

if TYPE_CHECKING:
    from ray.serve import Application
    from ray.serve.schema import ServeInstanceDetails

RAY_CLI_MODULE = "ray.scripts.scripts"
SERVE_WAITING_FOR_RESOURCES = "to be scheduled"

_internal_kv = LazyImport("ray.experimental.internal_kv")
_raylet = LazyImport("ray._raylet")
_state = LazyImport("ray._private.state")
_serve_context = LazyImport("ray.serve.context")
_serve_schema = LazyImport("ray.serve.schema")
_ray_constants = LazyImport("ray._private.ray_constants")
_ray_utils = LazyImport("ray._private.utils")


def deploy_app(app: Application, name: str) -> None:
    """Submit the application to Serve and return at once (no route prefix: the router is the HTTP entry)."""
    serve._run(app, _blocking=False, name=name, route_prefix=None)


def with_version(deployment: Any, version: str) -> Any:
    """The deployment with a code version of ours. Serve gives every deployment of an imperatively deployed
    application a random version, so each redeploy would restart every replica; with a version derived from
    what the replicas are built from, a redeploy restarts only what changed (an in-place update) and scales or
    reconfigures the rest. Ray 2.60 accepts it only from its own callers (`_internal`)."""
    return deployment.options(version=version, _internal=True)


def free_resources_per_node() -> dict[str, dict[str, float]]:
    return _state.available_resources_per_node()


def running_replicas(app: str, deployment: str) -> list[tuple[str, dict[str, float]]]:
    """Each running replica of the deployment: its Ray node id and what it holds (none when it is not deployed)."""
    details = serve_details().applications.get(app)
    found = details.deployments.get(deployment) if details else None
    if found is None:
        return []
    held = {k: float(v) for k, v in (found.required_resources or {}).items() if v}
    return [(r.node_id, held) for r in found.replicas if r.state == "RUNNING" and r.node_id]


def delete_app(name: str) -> None:
    """Ask Serve to delete the application; return without waiting."""
    serve.delete(name, _blocking=False)


def serve_details() -> ServeInstanceDetails:
    """The Serve controller's full view of its applications (raises when no controller runs)."""
    return _serve_schema.ServeInstanceDetails(**_serve_context._get_global_client().get_serve_details())


def kv_put(key: bytes, value: bytes, namespace: str) -> None:
    _internal_kv._internal_kv_put(key, value, overwrite=True, namespace=namespace)


def kv_get(key: bytes, namespace: str) -> bytes | None:
    return _internal_kv._internal_kv_get(key, namespace=namespace)


def kv_del(key: bytes, namespace: str) -> None:
    _internal_kv._internal_kv_del(key, namespace=namespace)


def kv_list(prefix: bytes, namespace: str) -> list[bytes]:
    return _internal_kv._internal_kv_list(prefix, namespace=namespace)


def connect_kv(gcs_address: str) -> None:
    """Make kv_put/kv_get/kv_del/kv_list work in this process, which is not a Ray driver, against that GCS (token
    auth as Ray reads it from the environment)."""
    _internal_kv._initialize_internal_kv(_raylet.GcsClient(address=gcs_address))


def no_failure_signal_handler() -> None:
    """The next `ray.init` of this process gives its core worker no absl failure-signal handler (its SIGTERM handler
    aborts the process 3 s after a SIGTERM: cluster/driver_signals.py)."""
    _ray_constants.load().RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


@contextlib.contextmanager
def ray_sets_no_sigterm_handler() -> Iterator[None]:
    """Within the block, Ray's `set_sigterm_handler` (what `ray.init` calls to make SIGTERM a sys.exit) does nothing."""
    utils = _ray_utils.load()
    original = utils.set_sigterm_handler
    utils.set_sigterm_handler = lambda _handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = original


def reload_ray_config() -> None:
    """Make Ray re-read its RAY_* env settings and its auth token (after RAY_AUTH_MODE / RAY_AUTH_TOKEN_PATH were
    set). The config first: Ray's own test helper orders it so, a token reload must not see the old mode."""
    _raylet.Config.initialize("")
    _raylet.AuthenticationTokenLoader.instance().reset_cache()


def node_ip_init_kwargs(node_ip: str | None) -> dict[str, Any]:
    """`ray.init` keyword arguments that attach the driver to the Ray node at node_ip (none: Ray's choice)."""
    return {"_node_ip_address": node_ip} if node_ip else {}


def check_gcs_auth(address: str) -> None:
    """Ask the GCS at `address` for its cluster id: raises AuthenticationError when it refuses this process's token."""
    _raylet.GcsClient(address=address)


def node_logs_dir() -> str:
    """The Ray session log dir of the node this worker runs on."""
    return ray._private.worker.global_worker.node.get_logs_dir_path()
