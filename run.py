"""Entry point: `python run.py --config-name serve action=run|status|logs|stop|dryrun|bench`."""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from flagscale.actions import dispatch, main_exit, report_error
from flagscale.config.cli import check_yaml_files, config_dir_of, upsert_overrides, without_hydra_config_copy
from flagscale.config.resolvers import register_resolvers
from flagscale.errors import FlagScaleError

CONFIG_DIR = Path(__file__).resolve().parent / "conf"
register_resolvers()


@hydra.main(config_path="conf", config_name="serve", version_base=None)
def main(cfg: DictConfig) -> None:
    main_exit(dispatch(cfg))


if __name__ == "__main__":
    try:
        check_yaml_files(sys.argv[1:], CONFIG_DIR, "serve")
    except FlagScaleError as exc:
        main_exit(report_error(exc))
    sys.argv[1:] = without_hydra_config_copy(upsert_overrides(sys.argv[1:], config_dir_of(sys.argv[1:], CONFIG_DIR)))
    main()
