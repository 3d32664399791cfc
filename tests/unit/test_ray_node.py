"""How `ray` is started: by this interpreter and Ray's CLI module, never through the `ray` console script; and on
which port the head listens."""

import subprocess
import sys

import pytest

from flagscale.cluster.hostfile import parse_hostfile
from flagscale.cluster.ray_node import RAY_CLI_MODULE, RayNode, head_port, ray_cli, ray_start_argv
from flagscale.cluster.runner import LocalRunner, Result
from flagscale.errors import ClusterError
from flagscale.launchers.ssh import host_node
from flagscale.net import port_is_free


def test_head_argv_starts_ray_with_this_interpreter(monkeypatch, tmp_path):
    # An install whose scripts landed elsewhere: no `ray` next to the interpreter.
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python3"))
    argv = ray_start_argv(RayNode("head", 6379, "/tmp/fsr-x", num_cpus=2, this_machine=True))
    assert argv[0] == str(tmp_path / "bin" / "python3")
    assert argv[argv.index("-m") + 1] == RAY_CLI_MODULE
    assert argv[len(ray_cli()) : len(ray_cli()) + 2] == ["start", "--head"]
    assert not any(word.endswith("/ray") for word in argv)


def test_multihost_argv_uses_the_same_cli(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("10.0.0.1 slots=1 type=cpu\n10.0.0.2 slots=1 type=cpu\n")
    hf = parse_hostfile(str(path))
    for entry in hf.hosts:
        argv = ray_start_argv(host_node(entry, hf.head, 6379, None, "/tmp/fsr-y"))
        assert argv[: len(ray_cli()) + 1] == [*ray_cli(), "start"]


def test_a_joining_node_needs_the_heads_ip():
    with pytest.raises(ValueError, match="head_ip is needed"):
        RayNode("worker", 6379, "/tmp/fsr-y")
    with pytest.raises(ValueError, match="role must be one of"):
        RayNode("client", 6379, "/tmp/fsr-y", head_ip="10.0.0.1")


def test_ray_cli_module_runs():
    """The module really is Ray's CLI in the installed Ray (what the console script calls)."""
    result = subprocess.run([*ray_cli(), "start", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--head" in result.stdout


class _RemoteHere(LocalRunner):
    """A runner that calls itself remote but runs on this machine: the remote free-port command, for real."""

    remote = True


class _AnswersWith(LocalRunner):
    remote = True

    def __init__(self, result: Result):
        super().__init__("head-host")
        self.result = result

    def run(self, argv, env=None, timeout_s=None) -> Result:
        return self.result


def test_head_port_is_ray_port_when_set_else_a_free_port_on_the_heads_host():
    assert head_port(_AnswersWith(Result(1, "", "")), 18810) == 18810
    for runner in (LocalRunner(), _RemoteHere()):
        port = head_port(runner, None)
        assert 0 < port < 65536 and port_is_free("127.0.0.1", port)


def test_head_port_names_the_host_when_it_cannot_find_one():
    with pytest.raises(ClusterError, match="head-host: could not find a free port.*python: not found"):
        head_port(_AnswersWith(Result(127, "", "python: not found")), None)
