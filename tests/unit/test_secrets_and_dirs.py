"""Secrets stay out of argv, printed configs, update diffs and the state file; /tmp directories are private and
checked; known_hosts grows by one appended line; serve_id is a safe name (issue 19)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import paramiko
import pytest

from flagscale.cluster.ssh import _SaveNewKeyPolicy, env_line, remote_command
from flagscale.cluster.tempdirs import UnsafeDirectory, ensure_dir_in_private_parent, ensure_private_dir
from flagscale.config.cli import without_hydra_config_copy
from flagscale.config.load import load_config
from flagscale.errors import ClusterError, ConfigError
from flagscale.update import diff, masked_config, snapshot

SECRET = "hf_s3cr3t_value_0123"


def config(**experiment):
    return load_config(
        {
            "experiment": {"exp_name": "t", "exp_dir": "/tmp/x", **experiment},
            "serve": [
                {"serve_id": "a", "engine_args": {"model": "m", "hf_token": SECRET, "max_num_batched_tokens": 64}}
            ],
        }
    )


def test_env_values_cross_ssh_on_stdin_not_in_the_remote_argv(tmp_path):
    env = {"HF_TOKEN": SECRET, "WITH SPACE": "a b'\n\"c"}
    command = remote_command(["sh", "-c", 'printf "%s|%s" "$HF_TOKEN" "$(cat)"'], env)
    assert SECRET not in command and "a b" not in command
    # The exact string sshd would hand to the remote shell, run here: the launcher gives argv the env, and argv's
    # stdin is /dev/null (the `cat` ends at once).
    out = subprocess.run(["sh", "-c", command], input=env_line(env), capture_output=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode() == f"{SECRET}|"
    assert shlex.split(remote_command(["echo", "a b"])) == ["echo", "a b"]


def test_update_diff_shows_a_changed_secret_without_its_value():
    old = snapshot(config(envs={"HF_TOKEN": "old-value", "PLAIN": "1"}), "key-one")
    new = snapshot(config(envs={"HF_TOKEN": SECRET, "PLAIN": "2"}), "key-two")
    text = "\n".join(c.describe() for c in diff(old, new))
    assert "experiment.envs.HF_TOKEN: changed (value not shown)" in text
    assert "experiment.runner.deploy.api_key_digest: changed (value not shown)" in text
    assert "experiment.envs.PLAIN: changed (value not shown)" in text
    assert SECRET not in text and "old-value" not in text and "key-two" not in text


def test_the_recorded_config_holds_digests_of_env_values_and_credential_args():
    recorded = json.dumps(snapshot(config(envs={"HF_TOKEN": SECRET, "nodes_envs": {"h": {"T": SECRET}}}), "k"))
    assert SECRET not in recorded
    again = snapshot(config(envs={"HF_TOKEN": SECRET, "nodes_envs": {"h": {"T": SECRET}}}), "k")
    assert diff(json.loads(recorded), again) == []
    assert '"max_num_batched_tokens": 64' in recorded  # not a credential


def test_dryrun_prints_env_names_and_masks_their_values():
    shown = json.dumps(masked_config(config(envs={"HF_TOKEN": SECRET}, runner={"deploy": {"api_key": SECRET}})))
    assert SECRET not in shown
    assert '"HF_TOKEN": "***"' in shown and '"hf_token": "***"' in shown and '"api_key": "***"' in shown


def test_hydra_is_told_not_to_copy_the_config_and_overrides_under_exp_dir():
    assert without_hydra_config_copy(["a=1"]) == ["a=1", "hydra.output_subdir=null"]
    assert without_hydra_config_copy(["hydra.output_subdir=x"]) == ["hydra.output_subdir=x"]


@pytest.mark.parametrize("serve_id", ["../x", "a/b", "..", ".hidden", "a b", "-rf"])
def test_an_unsafe_serve_id_is_refused_naming_the_key_and_value(serve_id):
    with pytest.raises(ConfigError) as error:
        load_config({"experiment": {"exp_name": "t", "exp_dir": "/tmp/x"}, "serve": [{"serve_id": serve_id}]})
    assert "serve_id" in str(error.value) and repr(serve_id) in str(error.value)


def test_a_run_dir_is_made_in_a_private_parent_and_an_existing_own_parent_narrowed(tmp_path):
    made = ensure_dir_in_private_parent(str(tmp_path / "new" / "ray"))
    assert os.stat(os.path.dirname(made)).st_mode & 0o777 == 0o700 and os.stat(made).st_mode & 0o777 == 0o700
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    ensure_dir_in_private_parent(str(mine / "ray"))
    assert mine.stat().st_mode & 0o777 == 0o700


def test_ray_opening_its_own_dir_to_everyone_does_not_block_the_next_run(tmp_path):
    ray_dir = ensure_dir_in_private_parent(str(tmp_path / "base" / "ray"))
    os.chmod(ray_dir, 0o777)  # what `ray start` does to its temp dir
    assert ensure_dir_in_private_parent(ray_dir) == ray_dir


def test_a_parent_others_can_write_or_a_link_is_refused_naming_it(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeDirectory, match=f"{shared} can be written by other users"):
        ensure_dir_in_private_parent(str(shared / "ray"))
    with pytest.raises(UnsafeDirectory, match=f"{shared} can be written by other users"):
        ensure_private_dir(str(shared))
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(UnsafeDirectory, match=f"{link} exists and is not a directory"):
        ensure_dir_in_private_parent(str(link / "ray"))
    with pytest.raises(UnsafeDirectory, match=f"{link} exists and is not a directory"):
        ensure_dir_in_private_parent(str(link))  # the run's dir itself a link, in a private parent


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory owned by someone else")
def test_a_dir_owned_by_someone_else_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 54321, 54321)
    with pytest.raises(UnsafeDirectory, match=f"{theirs} is owned by uid 54321"):
        ensure_dir_in_private_parent(str(theirs / "ray"))
    with pytest.raises(UnsafeDirectory, match=f"{theirs} is owned by uid 54321"):
        ensure_private_dir(str(theirs))


def test_the_ray_temp_dir_of_a_long_exp_dir_is_under_a_per_user_base(tmp_path):
    from flagscale.cluster.ray_node import ray_temp_dir

    long_dir = "/very/long/experiment/directory/name"
    temp = ray_temp_dir(long_dir)
    assert temp.startswith(f"/tmp/flagscale-{os.getuid()}/") and len(temp) <= 40
    assert ray_temp_dir("/e") == "/e/ray"


def test_a_new_host_key_is_appended_as_one_line_leaving_the_rest_as_it_was(tmp_path):
    known = tmp_path / "known_hosts"
    old = paramiko.Ed25519Key.from_private_key_file(str(_new_key(tmp_path / "old")))
    before = f"# kept comment\nold.example   ssh-ed25519 {old.get_base64()}"  # odd spacing, no final newline
    known.write_text(before)
    key = paramiko.Ed25519Key.from_private_key_file(str(_new_key(tmp_path / "new")))
    _SaveNewKeyPolicy(known).missing_host_key(None, "[10.0.0.9]:2222", key)
    assert known.read_text() == before + f"\n[10.0.0.9]:2222 ssh-ed25519 {key.get_base64()}\n"
    keys = paramiko.HostKeys(str(known))
    assert keys.lookup("[10.0.0.9]:2222")["ssh-ed25519"] == key


def _new_key(folder: Path) -> Path:
    folder.mkdir()
    path = folder / "id"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory owned by someone else")
def test_a_per_user_base_taken_by_someone_else_falls_back_to_the_users_cache(tmp_path, monkeypatch):
    """/tmp/flagscale-<uid> made first by another user blocks no run: the GPU / core locks and a long exp_dir's
    Ray temp dir go to a private directory under the user's own cache instead."""
    import tempfile

    from flagscale.cluster.ray_node import ray_temp_dir
    from flagscale.cluster.tempdirs import user_tmp_root
    from flagscale.replica import startup_lock

    tmp = tmp_path / "t"
    tmp.mkdir()
    assert user_tmp_root(str(tmp)) == f"{tmp}/flagscale-{os.getuid()}"  # free: the usual place
    theirs = tmp / f"flagscale-{os.getuid()}"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 54321, 54321)
    monkeypatch.setenv("FLAGSCALE_CACHE", str(tmp_path / "c"))
    assert user_tmp_root(str(tmp)) == str(tmp_path / "c" / "tmp")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with startup_lock.gpu_start_lock(["0"], timeout_s=5):
        assert (tmp_path / "c" / "tmp" / "gpu-start-0.lock").exists()
    assert stat.S_IMODE((tmp_path / "c" / "tmp").stat().st_mode) == 0o700

    short_cache = tempfile.mkdtemp(prefix="fc", dir="/tmp")  # Ray's socket paths must fit in 107 bytes
    try:
        monkeypatch.setenv("FLAGSCALE_CACHE", short_cache)
        temp = ray_temp_dir("/very/long/experiment/directory/name", tmp=str(tmp))
        assert temp.startswith(f"{short_cache}/tmp/")
        ensure_dir_in_private_parent(temp)
    finally:
        shutil.rmtree(short_cache)
    monkeypatch.setenv("FLAGSCALE_CACHE", str(tmp_path / ("x" * 80)))
    with pytest.raises(ClusterError, match="too long for Ray's socket paths"):
        ray_temp_dir("/very/long/experiment/directory/name", tmp=str(tmp))


def test_the_flagscale_command_line_it_echoes_masks_every_secret(capsys, monkeypatch):
    """`flagscale` prints the overrides it passes on: an API key, an env var's value and a credential engine arg
    given by --engine-args are shown as ***, the rest as given."""
    from flagscale.cli import hydra_entry
    from flagscale.cli.main import main

    monkeypatch.setattr(hydra_entry, "main", lambda *a, **k: None)
    main(
        [
            "serve",
            "demo",
            "--engine-args",
            json.dumps({"hf_token": SECRET, "max_model_len": 64}),
            f"experiment.runner.deploy.api_key={SECRET}1",
            f"++experiment.envs.HF_TOKEN={SECRET}2",
            f"serve.0.engine_args={{api_key:'{SECRET}3',max_num_seqs:4}}",
        ]
    )
    echoed = capsys.readouterr().err
    assert SECRET not in echoed, echoed
    assert "serve.0.engine_args.hf_token=***" in echoed and "experiment.runner.deploy.api_key=***" in echoed
    assert "experiment.envs.HF_TOKEN=***" in echoed and "{api_key:***,max_num_seqs:4}" in echoed
    assert "serve.0.engine_args.max_model_len=64" in echoed


def test_a_command_line_or_snippet_is_shown_with_its_secrets_masked():
    from flagscale.cluster.ray_node import with_before_start
    from flagscale.secrets import MASK, mask_argv, mask_env, mask_text

    argv = ["vllm", "--api-key", SECRET, f"--hf-token={SECRET}", "--port", "8000", "--model", "m"]
    assert mask_argv(argv) == ["vllm", "--api-key", MASK, f"--hf-token={MASK}", "--port", "8000", "--model", "m"]
    # cmds.before_start, logged to runner.log with the `ray start` it runs before
    snippet = f"export HF_TOKEN={SECRET}\nexport PATH=/opt/bin:$PATH\nhuggingface-cli login --token '{SECRET}'"
    shown = " ".join(mask_argv(with_before_start(["ray", "start"], snippet)))
    assert SECRET not in shown and "HF_TOKEN=***" in shown and "PATH=/opt/bin:$PATH" in shown
    assert mask_env({"HF_TOKEN": SECRET, "VLLM_HOST_IP": "10.0.0.1"}) == {"HF_TOKEN": MASK, "VLLM_HOST_IP": "10.0.0.1"}
    assert mask_text(json.dumps({"api_key": SECRET, "model": "m"})) == '{"api_key": ***, "model": "m"}'


def test_an_engine_log_shows_its_command_line_with_secrets_masked(tmp_path):
    from flagscale.replica.process import start_watched

    log_path = tmp_path / "engine.log"
    proc = start_watched(["true", "--api-key", SECRET], {**os.environ}, {"HF_TOKEN": SECRET}, log_path)
    proc.wait(timeout=60)
    first = log_path.read_text().splitlines()[0]
    assert SECRET not in first and "HF_TOKEN=***" in first and "--api-key ***" in first
