"""The one error type users see: a message that names the culprit, and a non-zero exit."""

from __future__ import annotations


class FlagScaleError(Exception):
    """An error the user can act on. `where` names the file, key, host or line at fault."""

    exit_code = 1

    def __init__(self, message: str, where: str | None = None):
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class ConfigError(FlagScaleError):
    exit_code = 2


class ClusterError(FlagScaleError):
    exit_code = 3


class DeployError(FlagScaleError):
    exit_code = 4


class NotSupportedError(ConfigError):
    """A FlagScale feature whose keys load but which this project does not serve yet."""
