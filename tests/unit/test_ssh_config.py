"""How a hostfile host is reached: the ssh config file (Host aliases, HostName, User, Port, IdentityFile,
ProxyJump), explicit runner.ssh_* keys winning; and the runners' sessions on this machine."""

from __future__ import annotations

import pytest

from flagscale.cluster import ssh
from flagscale.cluster.processes import read_process, session_members
from flagscale.cluster.runner import CommandTimeout, LocalRunner, SshRunner, runner_for
from flagscale.config.schema import RunnerConfig


@pytest.fixture
def config(tmp_path):
    key, jump_key = tmp_path / "node_key", tmp_path / "jump_key"
    key.write_text("not a real key\n")
    jump_key.write_text("not a real key\n")
    path = tmp_path / "ssh_config"
    path.write_text(f"""
Host node1
    HostName 10.9.0.2
    User alice
    Port 2202
    IdentityFile {key}
    IdentityFile {tmp_path}/missing_key
Host node2
    HostName 10.9.0.3
    ProxyJump bob@bastion:2200,node1
Host bastion
    HostName 10.9.0.1
    IdentityFile {jump_key}
    IdentitiesOnly yes
Host *
    User carol
""")
    return path


def test_alias_gives_hostname_user_port_and_existing_identity_files(config, tmp_path):
    target = ssh.resolve("node1", ssh.SshSettings(config=str(config)))
    assert (target.hostname, target.user, target.port) == ("10.9.0.2", "alice", 2202)
    assert target.keys == [str(tmp_path / "node_key")] and not target.explicit_key  # the missing one is skipped
    assert target.proxy_jump == []


def test_explicit_settings_win_over_the_file(config, tmp_path):
    settings = ssh.SshSettings(port=18822, user="root", key=str(tmp_path / "mine"), config=str(config))
    target = ssh.resolve("node1", settings)
    assert (target.hostname, target.user, target.port) == ("10.9.0.2", "root", 18822)
    assert target.keys == [str(tmp_path / "mine")] and target.explicit_key


def test_host_not_in_the_file_keeps_its_name_and_the_defaults(config, tmp_path):
    target = ssh.resolve("10.1.1.1", ssh.SshSettings(config=str(config)))
    assert (target.hostname, target.user, target.port, target.keys) == ("10.1.1.1", "carol", 22, [])
    no_file = ssh.resolve("node1", ssh.SshSettings(config=str(tmp_path / "absent")))
    assert (no_file.hostname, no_file.user, no_file.port) == ("node1", None, 22)


def test_proxy_jump_hops_with_their_own_entries(config, tmp_path):
    target = ssh.resolve("node2", ssh.SshSettings(port=18822, user="root", config=str(config)))
    assert (target.hostname, target.port, target.user) == ("10.9.0.3", 18822, "root")
    assert target.proxy_jump == ["bob@bastion:2200", "node1"]
    settings = ssh.SshSettings(port=18822, user="root", key="/explicit/key", config=str(config))
    first, second = (ssh._hop_target(spec, settings) for spec in target.proxy_jump)
    # A hop uses its own ssh config entry and the spec's user/port, never the explicit ssh_* keys.
    assert (first.hostname, first.port, first.user) == ("10.9.0.1", 2200, "bob")
    assert first.keys == [str(tmp_path / "jump_key")] and first.identities_only
    assert (second.hostname, second.port, second.user) == ("10.9.0.2", 2202, "alice")


def test_schema_leaves_ssh_port_to_the_file_unless_set(config):
    runner = RunnerConfig()
    assert runner.ssh_port is None and runner.ssh_config is None
    settings = ssh.SshSettings.from_runner(RunnerConfig(ssh_config=str(config)))
    assert ssh.resolve("node1", settings).port == 2202
    settings = ssh.SshSettings.from_runner(RunnerConfig(ssh_config=str(config), ssh_port=22))
    assert ssh.resolve("node1", settings).port == 22
    # A state file written before ssh_config existed still loads.
    assert (
        ssh.SshSettings(
            **{
                "port": 22,
                "user": None,
                "key": None,
                "timeout_s": 10.0,
                "accept_new_host_keys": False,
                "known_hosts": None,
            }
        ).config
        is None
    )


def test_runner_for_a_recorded_host():
    assert isinstance(runner_for("localhost", False), LocalRunner)
    remote = runner_for("node1", True, ssh.SshSettings(port=2222))
    assert isinstance(remote, SshRunner) and remote.host == "node1" and remote.settings.port == 2222


def test_local_session_is_recorded_with_its_start_and_stopped_exactly(tmp_path):
    runner = LocalRunner()
    go = tmp_path / "go"  # the leader lives until the test has read it (no race with a fast exit)
    leader = f"sleep 60 & while [ ! -e {go} ]; do sleep 0.05; done; echo up"
    session = runner.start_session(["sh", "-c", leader], {}, str(tmp_path / "s.log"), 30)
    assert session.start_ticks == read_process(session.id).start_ticks
    go.touch()
    result = session.wait()
    assert result.code == 0 and result.stdout == "up"
    assert session_members(session.id)  # the background sleep is still in the session
    assert runner.stop_session(session.id, session.start_ticks) == []
    assert session_members(session.id) == []


def test_local_run_past_its_bound_kills_its_session():
    with pytest.raises(CommandTimeout) as info:
        LocalRunner().run(["sh", "-c", "echo partial; sleep 30"], timeout_s=0.5)
    assert "partial" in info.value.output and "killed" in str(info.value)
