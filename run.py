"""Entry point: `python run.py --config-name serve action=run|status|logs|stop|dryrun|bench`.

The same Hydra entry as the installed `flagscale` command (flagscale/cli/hydra_entry.py)."""

from pathlib import Path

from flagscale.cli.hydra_entry import main

if __name__ == "__main__":
    main(base_dir=Path(__file__).resolve().parent)  # a relative --config-path is read against this directory
