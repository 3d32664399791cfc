"""Library chatter stays off the console and lands in the run's log file (runner.log); the project's lines and
libraries' errors still reach the console (flagscale/actions/runner_log.py)."""

from __future__ import annotations

import io
import logging

import pytest

from flagscale.actions import runner_log


@pytest.fixture
def console_root():
    """The root logger as Hydra's job logging leaves it: one console handler, level INFO; restored afterwards."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    serve = logging.getLogger(runner_log.SERVE_LOGGER)
    project = logging.getLogger(runner_log.PROJECT)
    saved_loggers = [(lg, lg.handlers[:], lg.propagate, lg.level) for lg in (serve, project)]
    out = io.StringIO()
    root.handlers = [logging.StreamHandler(out)]
    root.setLevel(logging.INFO)
    project.handlers, project.propagate = [], True
    serve.handlers, serve.propagate = [logging.StreamHandler(out)], False  # as `import ray.serve` leaves it
    serve.setLevel(logging.INFO)
    yield out
    for handler in root.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.close()
    root.handlers, root.level = saved
    for lg, handlers, propagate, level in saved_loggers:
        lg.handlers, lg.propagate, lg.level = handlers, propagate, level


def test_library_lines_are_held_off_the_console_then_written_to_the_log_file(console_root, tmp_path):
    runner_log.keep_library_lines_off_the_console()
    logging.getLogger("vllm.triton_utils.importing").warning("Triton is installed, but ... Disabling Triton.")
    logging.getLogger("flagscale.plan").warning("a project warning")
    logging.getLogger("some.library").error("a library error")
    runner_log.route_serve_logger()
    logging.getLogger("ray.serve").info('Started Serve in namespace "serve".')
    console = console_root.getvalue()
    assert "a project warning" in console and "a library error" in console
    assert "Triton" not in console and "Started Serve" not in console
    path = tmp_path / "runner.log"
    runner_log.log_to_file(path)
    logging.getLogger("ray.serve").info("Deleting app ['demo']")
    logging.getLogger("flagscale.run").info("a project line after the file")
    written = path.read_text()
    for line in ("Disabling Triton", "Started Serve", "Deleting app", "a project line after the file"):
        assert line in written, (line, written)
    assert "Deleting app" not in console_root.getvalue()
    assert "a project line after the file" not in console_root.getvalue()  # the console shows the summary
    runner_log.log_to_file(path)  # once per file
    logging.getLogger("flagscale.run").info("once")
    assert path.read_text().count("once") == 1
