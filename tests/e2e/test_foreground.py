"""`foreground=true`: run stays attached and Ctrl-C stops everything it started."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

from flagscale.cluster.processes import session_members
from tests.conftest import REPO, end_run_process, llama_cpp_node, write_config

PORT = 18911


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_ctrl_c_stops_everything(tmp_path):
    """Started the way a shell starts a background job (SIGINT ignored, as CI runners often do):
    SIGINT must still stop the run."""
    exp_dir = tmp_path / "exp"
    conf = write_config(tmp_path / "conf", [llama_cpp_node("fg")], exp_dir, PORT)
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "run.py"), "--config-path", str(conf), "--config-name", "serve", "foreground=true"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        preexec_fn=ignore_sigint,
    )
    lines = []
    try:
        deadline = time.monotonic() + 600
        for line in proc.stdout:
            lines.append(line)
            if "press Ctrl-C" in line or time.monotonic() > deadline:
                break
        assert any("press Ctrl-C" in ln for ln in lines), "".join(lines)
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=5) as resp:
            assert resp.status == 200
        sessions = [h["session"] for h in json.loads((exp_dir / "state.json").read_text())["hosts"]]
        assert any(session_members(s) for s in sessions)
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=300)[0]
    finally:
        end_run_process(proc, conf, exp_dir)
    assert proc.returncode == 0, "".join(lines) + rest
    assert "stopped" in rest
    assert not [p for s in sessions for p in session_members(s)]
    assert not (exp_dir / "state.json").exists()
