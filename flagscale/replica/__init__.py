"""The engine replica: a Ray Serve replica that owns one engine server and everything that server runs.

engine.py: EngineReplica (start, health, autoscaling stats, drain) and its EngineSpec; process.py: the server's
env, process group and log, and starting a process under engine_proc (the server's, other hosts' ranks');
engine_proc.py: the wrapper that keeps the server from outliving the replica. A replica's ranks (TP x PP x DP > 1):
ranks.py, across the hosts it spans (ReplicaRanks); rank_layout.py: which host runs which ranks, and dryrun's
preview; bundles.py: the replica's placement group as Ray placed it; host_ranks.py: one other host's ranks (the
RemoteRanks actor, worker pids); cores.py: the cores a host's CPU ranks claim. cpu_layout.py: the cores of a CPU
engine's processes; startup_lock.py: engines sharing a GPU start in turn; autoscaling.py: the load Serve scales
on; slo_signals.py + slo_policy.py: the SLO planner as Serve's policy (what replicas report, what it decides and
publishes); sleep.py: an idle engine put to sleep (resources.sleep_delay_s); registry.py: the records the router reads to find replicas;
liveness.py: which of them are alive, by the reader's own clock; adapters.py: the node's LoRA adapters loaded and
unloaded through the engine's runtime routes (EngineReplica.reconfigure); runtime_adapters.py: a node's adapter set
given at run time (the router's admin call), which stands in for its config's.

It talks to its engine only through the engine kind (flagscale.engines: EngineKind) and names none. It may import
flagscale.engines, flagscale.config, flagscale.cluster (Ray helpers, private directories) and the basics (errors,
net, devices, paths); never the router, the launchers, the plan or the actions above it.
"""
