"""action=auto_tune (docs/auto-tune.md): a grid of one engine node's settings, each deployed on the real target and
loaded with vLLM's serving benchmark; the best one by goodput per device under an SLO, or by FlagScale's metric.

space.py: the config's space (both FlagScale shapes) -> candidates, each a config; checks before any trial
prune.py: what cannot fit (the plan's placement checks; weights + KV cache arithmetic), with the reason
trial.py: one candidate deployed (run, or update in place) and loaded at rising concurrency; goodput
history.py: exp_dir/auto_tuner/history.csv, one row per candidate; the key that lets a second search resume
report.py: ranking, the table, the plot, the best config as a config tree
"""
