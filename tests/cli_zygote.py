"""The test suites' CLI runs, forked from one process that has imported the CLI once (tests/conftest.py:run_cli).

A `run.py` process spends seconds importing before it does anything: Hydra and the project (~1 s), Ray (~1.5 s), and
for every engine argv it has not seen, vLLM's `vllm serve` parser with torch under it (~9 s on CI's 2 cores). The
suites run the CLI a few hundred times, so that alone was a quarter of CI. This process imports all of it once and
then forks a child per command line: the child runs the same entry as `run.py` (flagscale.cli.hydra_entry.main) in
its own process, with its own argv, environment, working directory, stdout and stderr, and exits with the action's
code. Tests of the installed command and of signals start real processes instead (test_cli.py, test_examples.py,
test_run_signals.py, the Popen calls in the e2e suites).

Protocol: one JSON request per line on stdin {"id", "argv", "env", "cwd", "stdout", "stderr"} (the last two: files
the child writes), and "entry": "flagscale" for the `flagscale` command's entry instead of run.py's. Answers, one JSON line each: {"id", "pid"} once the child is forked (the caller kills its process
group if it overruns, after a SIGUSR1 that has the child write its threads' stacks to its stderr), {"pid", "returncode"} once it has exited. Requests are served at once, each in its child.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import sys
import threading
import time
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def preload() -> None:
    sys.path.insert(0, str(REPO))
    import ray  # noqa: F401
    import ray.serve  # noqa: F401

    import flagscale.cli.hydra_entry  # noqa: F401
    from flagscale.engines import vllm_args

    vllm_args.vllm_serve_parser()


def child(request: dict) -> None:
    """In the forked child: become the CLI process the request describes, run it, exit with its code."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group, as a subprocess the caller can kill as a whole
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # Ray read its RAY_* settings (token auth among them) when this zygote imported it, from the zygote's
        # environment: read again from the request's, as a fresh process would.
        from flagscale.cluster.ray_compat import reload_ray_config

        reload_ray_config()
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, fd)
            os.close(out)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        try:
            if request.get("entry") == "flagscale":  # the console script's entry (pyproject.toml)
                from flagscale.cli.main import main

                sys.argv = ["flagscale", *request["argv"]]
                main(request["argv"])
            else:
                from flagscale.cli.hydra_entry import main

                sys.argv = [str(REPO / "run.py"), *request["argv"]]
                main(request["argv"], base_dir=REPO)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - as an uncaught exception ends a fresh process
            import traceback

            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110
                pass
        os._exit(code)


def serve() -> None:
    preload()
    # The preloaded modules' weakref finalizers (torch's custom-op libraries, which vLLM registers by the hundred)
    # would run again at the exit of every child, which a fresh `run.py` never pays for what it did not import: a
    # status child spent over 78 s exiting in torch.library._del_library on a busy 2-core machine.
    for finalizer in list(weakref.finalize._registry):
        finalizer.atexit = False
    # A caller whose command overran asks for its threads' stacks before it kills it: written to fd 2, which in
    # a child is the request's stderr file from its first moments (the handler is inherited through fork).
    faulthandler.register(signal.SIGUSR1, file=2, all_threads=True)
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing else of this process writes where answers go
    lock = threading.Lock()

    def answer(message: dict) -> None:
        with lock:
            replies.write(json.dumps(message) + "\n")

    def reap() -> None:
        while True:
            try:
                pid, status = os.wait()
            except ChildProcessError:  # none running: look again soon
                time.sleep(0.05)
                continue
            answer({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})

    threading.Thread(target=reap, daemon=True).start()
    answer({"ready": os.getpid()})
    for line in sys.stdin:
        request = json.loads(line)
        with lock:  # (not forked while the reaper writes an answer)
            pid = os.fork()
            if pid == 0:
                replies.close()
                child(request)
        answer({"id": request["id"], "pid": pid})


if __name__ == "__main__":
    serve()
