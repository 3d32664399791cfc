"""The Ray Serve application built from a plan (app.py): one deployment per engine node (flagscale/replica/), the
router deployment in front (flagscale/router/), and a graph of custom nodes with its driver (graph.py).

May import every floor below it: plan, launchers, router, replica, cluster, config, engines and the basics.
"""
