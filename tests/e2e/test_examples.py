"""Every config the project ships (conf/ and examples/) passes dryrun through the real CLI: nothing started."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, run_cli

SHIPPED = [
    (REPO / "conf", "serve"),
    *[
        (REPO / "examples" / "graph" / "conf", p.stem)
        for p in sorted((REPO / "examples" / "graph" / "conf").glob("*.yaml"))
    ],
]


@pytest.mark.parametrize("conf_dir, name", SHIPPED, ids=[f"{d.relative_to(REPO)}/{n}" for d, n in SHIPPED])
def test_shipped_config_dryruns(conf_dir, name, tmp_path):
    result = run_cli(conf_dir, "action=dryrun", f"experiment.exp_dir={tmp_path}", name=name, timeout=300)
    assert result.returncode == 0, result.output
    assert "dryrun: nothing was started" in result.stdout
    assert "router: 1 process(es)" in result.stdout  # CPU deployments: one router process by default
