"""The config: one typed schema and everything that reads a YAML into it.

schema.py: the schema, `ServeConfig`, assembled from experiment.py (`experiment:`), tuner.py (its `auto_tuner:`),
node.py (one node of `serve:`) and fields.py (what they share); their field docs are docs/config.md's; load.py, cli.py: from files and overrides to the
schema; compat.py: FlagScale's older layouts mapped onto it, with a notice for each rewrite or ignored key;
graph.py: graphs of custom nodes; request.py: a graph's request fields; replicas.py: a node's replica settings;
lora.py: a node's LoRA adapters (`lora:` and the engine's spellings), what an adapter's directory holds;
routing.py: a node's routing as planned (its policy and that policy's settings) and the router's admission bounds;
resolvers.py: `${demo_model:}` in configs; reference.py: docs/config.md's tables.

It may import flagscale.engines (the engine names and each kind's facts), flagscale.router.policies (the policies'
names and settings types, which sit below config), flagscale.demo_model and the basics (errors, net, devices,
paths); never the cluster, the replica, the rest of the router or anything above them.
"""
