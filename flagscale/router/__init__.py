"""The router: the OpenAI-compatible endpoint in front of the engine replicas (docs/routing.md, docs/design.md).

Owns the HTTP face (frontend.py, client_request.py), admission (admission.py), the request path across replicas
with every retry and resume decision (failover.py, resume.py; what an answer says of its replica: verdict.py), the
relay of streamed answers (exchange.py, upstream_http.py), the prefill step of disaggregated models (pd.py), the
replicas' state, policies and circuit breakers (replicas.py, circuit_breaker.py), the routing policies
(policies/: one module each, one registry), what the router processes of a deployment share (peers.py), the
process's counters and clients (state.py), /metrics (metrics.py), and the client keys it accepts and the key it
sends the engines (keyring.py). `Router` (router.py) is the Ray Serve replica that runs them, each part handed only
the collaborators it uses; `RouterSpec` (spec.py) is what it is given.

May import: flagscale's basics, engines (capabilities), config (routing as planned), cluster (Ray's key-value
store) and replica (the registry the replicas write, CPU layout). This __init__ imports nothing: the config
schema imports policies/ for the policies' names without pulling in aiohttp.
"""
