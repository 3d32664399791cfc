"""Where log lines go while an action runs: the console shows what the user asked for; the project's own log lines
and the libraries' chatter (Ray Serve's INFO lines, vLLM's Triton checks) go to the run's log file,
exp_dir/serve_logs/runner.log, once the action has one (run, stop).

Hydra's job logging gives the root logger a console handler: from the action's start, it shows the project's lines
and only errors of the libraries; the others are held (a bounded buffer) and written to the log file first thing
when there is one. Ray Serve logs through a console handler of its own, set up when `ray.serve` is imported:
route_serve_logger, right after that import, hands its lines to the root logger like any library's.
"""

from __future__ import annotations

import logging
import logging.handlers
from pathlib import Path

from flagscale.adaptors import serve
from flagscale.paths import private_file

PROJECT = "flagscale"
LOG_DIR = "serve_logs"  # <exp_dir>/serve_logs: where `run` writes runner.log and the engines their logs
RUNNER_LOG = "runner.log"
SERVE_LOGGER = "ray.serve"
HELD_RECORDS = 10_000  # library lines kept for the log file until there is one (the oldest go first)
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _ProjectOrErrors(logging.Filter):
    """On the console: the project's lines, and the libraries' errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.split(".")[0] == PROJECT or record.levelno >= logging.ERROR


class _Held(logging.handlers.BufferingHandler):
    """The libraries' lines before there is a log file, flushed into it once there is."""

    def __init__(self):
        super().__init__(HELD_RECORDS)

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] != PROJECT:
            if len(self.buffer) >= self.capacity:
                self.buffer.pop(0)
            self.buffer.append(record)

    def shouldFlush(self, record: logging.LogRecord) -> bool:  # noqa: N802 - logging's name
        return False

    def flush_into(self, handler: logging.Handler) -> None:
        for record in self.buffer:
            handler.handle(record)
        self.buffer.clear()


class _ToRoot(logging.Handler):
    """Hands a record to the root logger's handlers only (not to the loggers between: Ray's has a console
    handler of its own)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger().handle(record)


_FILTER = _ProjectOrErrors()


def _console_handlers(logger: logging.Logger) -> list[logging.Handler]:
    return [h for h in logger.handlers if type(h) is logging.StreamHandler]


def keep_library_lines_off_the_console() -> None:
    """From now on the root logger's console handlers show the project's lines and libraries' errors only; the
    libraries' other lines are held for the log file (log_to_file)."""
    root = logging.getLogger()
    for handler in _console_handlers(root):
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)
    if not any(isinstance(h, _Held) for h in root.handlers):
        root.addHandler(_Held())


def route_serve_logger() -> None:
    """Ray Serve's lines to the root logger's handlers (and so off the console, to the log file). Importing
    `ray.serve` gives its logger a console handler of its own: it is imported here first, then routed."""
    serve.load()
    logger = logging.getLogger(SERVE_LOGGER)
    for handler in _console_handlers(logger):
        logger.removeHandler(handler)
    if not any(isinstance(h, _ToRoot) for h in logger.handlers):
        logger.addHandler(_ToRoot())
    logger.propagate = False


def runner_log_path(exp_dir: str | Path) -> Path:
    return Path(exp_dir) / LOG_DIR / RUNNER_LOG


def log_to_file(path: Path) -> None:
    """The project's log lines (not on the console, which shows the summary) and the libraries' (the ones held
    so far first) to `path`, from now on. Once per file."""
    path = Path(path).absolute()
    root = logging.getLogger()
    if any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path for h in root.handlers):
        return
    handler = logging.FileHandler(private_file(path))  # 0600, also when an earlier version left it 0644
    handler.setFormatter(logging.Formatter(FORMAT))
    for held in [h for h in root.handlers if isinstance(h, _Held)]:
        held.flush_into(handler)
        root.removeHandler(held)
    root.addHandler(handler)
    project = logging.getLogger(PROJECT)
    project.addHandler(handler)
    project.setLevel(logging.INFO)
    project.propagate = False
