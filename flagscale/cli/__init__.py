"""The `flagscale` command (FlagScale v1.0's CLI) and the Hydra entry that it and run.py share.

Owns: argv -> (config dir, config name, Hydra overrides) (argv.py), where the shipped conf/ and examples/ are
(resources.py), the argparse front (main.py) and the one Hydra entry (hydra_entry.py). Top floor: it may import
anything in flagscale; nothing imports it.
"""
