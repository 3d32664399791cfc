"""Keeps an engine server (vLLM's, llama-server, ...) from outliving the replica that started it.

`python -m flagscale.replica.engine_proc <argv...>` runs argv as a child, forwards SIGTERM/SIGINT to it,
and kills it if its own parent (the Serve replica) disappears, e.g. after a SIGKILL. It imports nothing
heavy, so it costs a few MB.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main() -> int:
    argv = sys.argv[1:]
    parent = os.getppid()
    child = subprocess.Popen(argv)

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        code = child.poll()
        if code is not None:
            return code
        if os.getppid() != parent:
            child.terminate()
            try:
                return child.wait(10)
            except subprocess.TimeoutExpired:
                if os.getpgid(0) == os.getpid():  # our own group (process.spawn_engine): the server's children too
                    os.killpg(0, signal.SIGKILL)
                child.kill()
                return child.wait()
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
