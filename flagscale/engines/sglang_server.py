"""One replica's SGLang server: `python -m sglang.launch_server` with the API key taken from the environment.

SGLang reads its key only from `--api-key`, and a process's command line is readable by every user of the host;
this module adds the key to SGLang's arguments inside the process (its /proc cmdline keeps the argv it was started
with) and then runs SGLang's own entry point as `__main__`. SGLang logs its whole ServerArgs at start, key included
(`server_args=ServerArgs(... api_key='...')`), so this process's stdout and stderr, where its logging writes, show
the key as `***`.
"""

from __future__ import annotations

import io
import os
import runpy
import sys

KEY_ENV = "FLAGSCALE_SGLANG_API_KEY"
MASK = "***"


class Masked(io.TextIOBase):
    """A text stream that writes `secret` as `***`. Python's logging writes each record in one call, so a key is
    never split between two writes."""

    def __init__(self, stream, secret: str):
        self.stream, self.secret = stream, secret

    def write(self, text: str) -> int:
        self.stream.write(text.replace(self.secret, MASK))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()


def main() -> None:
    key = os.environ.pop(KEY_ENV, None)
    if key:
        sys.argv += ["--api-key", key]
        sys.stdout, sys.stderr = Masked(sys.stdout, key), Masked(sys.stderr, key)
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
