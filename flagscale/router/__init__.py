"""The router: the OpenAI-compatible endpoint in front of the engine replicas (docs/routing.md, docs/design.md).

Owns the HTTP face (frontend.py, client_request.py), admission (admission.py), the request path across replicas with
every retry and resume decision (failover.py, resume.py; what an answer says of its replica: verdict.py), the relay of
streamed answers (exchange.py, upstream_http.py), the prefill step of disaggregated models (pd.py), the replicas' state,
policies and circuit breakers (replicas.py, circuit_breaker.py), the wake of a sleeping replica and the replicas a
planned node keeps awake (wake.py), the routing policies (policies/: one module each, one registry;
policies/adapters.py: where a LoRA adapter's requests go, lora.py: its wiring and metrics), the engines' own KV events
that cache_aware routes on (kv_events.py: the subscriptions; kv_index.py: the blocks each replica holds; kv_keys.py: a
request's block keys as the engine computes them; token_prefixes.py: prompt prefixes tokenized once), the LoRA admin
call (adapter_admin.py: a node's adapters changed at run time, with the engine key), what the router processes of a
deployment share (peers.py), the process's counters and clients (state.py), the client keys it accepts and the key it
sends the engines (keyring.py), /metrics (metrics.py; the SLO planners' and held requests' series: planner_metrics.py),
requests held for a model at zero replicas while Serve starts one (cold_start.py). `Router` (router.py) is the Ray Serve
replica that runs them, each part handed only the collaborators it uses; `RouterSpec` (spec.py) is what it is given.

May import: flagscale's basics, engines (capabilities), config (routing as planned), cluster (Ray's key-value store) and
replica (the registry the replicas write, CPU layout). This __init__ imports nothing: the config schema imports
policies/ for the policies' names without pulling in aiohttp.
"""
