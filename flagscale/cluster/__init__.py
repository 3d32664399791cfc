"""What every launcher (flagscale/launchers/) shares: running commands on a host (runner.py: this machine or SSH,
ssh.py), Ray nodes as recorded sessions (ray_node.py, processes.py, ray_env.py, ray_compat.py: every private Ray
API; driver_signals.py: a driver keeps its own SIGTERM handler across ray.init), the exp_dir's state file, lock and temp
dirs (state.py, lock.py, tempdirs.py), the hosts of a run (hostfile.py: a
hostfile; slurm.py: the Slurm allocation this runs in, as a hostfile; both pick the head alike), an existing Ray
cluster's facts (ray_facts.py) and its nodes' engine log dir (node_logs.py), and placement (what each replica
reserves on a target, placement.py; what GPU memory it needs to fit, gpu_memory.py; and how a replica splits over
hosts, host_split.py: arithmetic only, no network;
the port probes are flagscale/net.py's).

It may import the basics (errors, net, devices) and config/; never the launchers, the replica, the router or
anything above them.
"""
