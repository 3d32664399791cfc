"""What the project treats as a secret and how one is shown: as MASK, wherever a config, a command line or a shell
snippet is printed or logged. A secret is a value whose key, flag or variable is named like a credential
(SECRET_NAME: api_key, hf_token, --api-key, HF_TOKEN, password, ...) or any env var value of the config
(experiment.envs.*). Imports nothing of the project, so every floor may use it."""

from __future__ import annotations

import os
import re
from pathlib import Path

SECRET_NAME = re.compile(r"(^|_)(api_?key|token|secret|password|passwd|credentials?)($|_)", re.IGNORECASE)
MASK = "***"
ENV_PATH = "experiment.envs."  # every env var value of the config: HF_TOKEN, a proxy URL with a password, ...

_QUOTED = r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\""
# name=value, name: value, "name": value (an override, a shell assignment, YAML or JSON); a value that opens a {...}
# or [...] is looked into instead
_ASSIGNED = re.compile(
    rf"(?P<q>[\"']?)(?P<name>[+~]*[A-Za-z_][\w.\-]*)(?P=q)(?P<sep>\s*[=:]\s*)(?P<value>{_QUOTED}|[^\s,{{}}\[\]'\"]+)"
)
# --flag value (a command line in one string)
_FLAG_VALUE = re.compile(rf"(?P<name>--[A-Za-z][\w\-]*)(?P<sep>\s+)(?P<value>{_QUOTED}|[^\s\-'\"]\S*)")


def secret_name(name: str) -> bool:
    """Whether a key, a flag or a variable of that name holds a secret (a dotted path: by its last part)."""
    return bool(SECRET_NAME.search(name.rpartition(".")[2].lstrip("-").replace("-", "_")))


def secret_path(path: str) -> bool:
    """Whether a config key (dotted, as an override names it: `++experiment.envs.HF_TOKEN`) holds a secret."""
    path = path.lstrip("+~")
    return path.startswith(ENV_PATH) or secret_name(path)


def mask_text(text: str) -> str:
    """`text` with the value of every secret assignment (`HF_TOKEN=...`, `api_key: ...`, `--hf-token ...`) as MASK."""

    def hide(match: re.Match) -> str:
        if not secret_path(match["name"]):
            return match[0]
        return match[0][: match.start("value") - match.start()] + MASK

    return _FLAG_VALUE.sub(hide, _ASSIGNED.sub(hide, text))


def mask_argv(argv: list[str]) -> list[str]:
    """A command line as it may be shown: the word after a secret flag (`--api-key KEY`) and each word's secret
    assignments (`--api-key=KEY`, `experiment.runner.deploy.api_key=KEY`, `{hf_token:KEY}`, a shell snippet's
    `export HF_TOKEN=...`) as MASK."""
    shown: list[str] = []
    for word in argv:
        after_secret_flag = bool(shown) and shown[-1].startswith("--") and "=" not in shown[-1]
        if after_secret_flag and secret_name(shown[-1]) and not word.startswith("-"):
            shown.append(MASK)
        else:
            shown.append(mask_text(word))
    return shown


def mask_env(env: dict[str, str]) -> dict[str, str]:
    """An environment as it may be shown: the values of variables named like a credential as MASK."""
    return {name: MASK if secret_name(name) else value for name, value in env.items()}


def secret_file(path: Path, min_chars: int = 32) -> str:
    """The secret kept in `path` (a deployment's, in its exp_dir): read, or made there (0600, 64 random hex
    digits) by the first caller. The same across updates and restarts, so every process `run` starts for the
    deployment is given the same one. A file cut short (a write interrupted) is made again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        secret = path.read_text().strip()
        if len(secret) >= min_chars:
            path.chmod(0o600)  # (a copy of the exp_dir may have lost its mode)
            return secret
        path.unlink()
        return secret_file(path, min_chars)
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(32).hex())
    return path.read_text().strip()
