"""One replica's SGLang server: `python -m sglang.launch_server` with the API key taken from the environment.

SGLang reads its key only from `--api-key`, and a process's command line is readable by every user of the host;
this module adds the key to SGLang's arguments inside the process (its /proc cmdline keeps the argv it was started
with) and then runs SGLang's own entry point as `__main__`.
"""

from __future__ import annotations

import os
import runpy
import sys

KEY_ENV = "FLAGSCALE_SGLANG_API_KEY"


def main() -> None:
    key = os.environ.pop(KEY_ENV, None)
    if key:
        sys.argv += ["--api-key", key]
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
