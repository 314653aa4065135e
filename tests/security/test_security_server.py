"""The vLLM server's guards without a vLLM engine: the token middleware (real ASGI calls), the warning for a server
reachable from other machines, and the worker extension's argument checks. tests/vllm/test_vllm.py runs the same guards
on a real `trl-es vllm-serve` (unauthenticated clients, malformed calls, a third party changing the weights)."""

import asyncio
import json

import pytest

from trl_es.commands.vllm_serve import TokenMiddleware, reachable_from_other_machines, serve_command
from trl_es.generation.vllm_payload import parse_payload


def status(middleware, path, headers=()):
    """The status an ASGI request to `path` gets through `middleware`."""
    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "method": "POST", "headers": list(headers)}
    asyncio.run(middleware(scope, None, send))
    return sent[0]["status"]


def test_every_endpoint_but_health_needs_the_token(monkeypatch):
    monkeypatch.setenv("TRL_ES_VLLM_TOKEN", "s3cret")
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    middleware = TokenMiddleware(app)
    assert status(middleware, "/health") == 200 and reached == ["/health"]
    for path in ("/collective_rpc", "/v1/completions", "/v1/models", "/reset_prefix_cache", "/metrics"):
        assert status(middleware, path) == 401
        assert status(middleware, path, [(b"authorization", b"Bearer guess")]) == 401
        assert reached[-1] != path  # vLLM never saw them
        assert status(middleware, path, [(b"authorization", b"Bearer s3cret")]) == 200 and reached[-1] == path


def test_a_server_without_a_token_does_not_start(monkeypatch):
    monkeypatch.delenv("TRL_ES_VLLM_TOKEN", raising=False)
    with pytest.raises(RuntimeError, match="TRL_ES_VLLM_TOKEN"):
        TokenMiddleware(lambda *args: None)


def test_hosts_beyond_loopback_are_flagged_and_the_middleware_is_installed():
    assert not any(map(reachable_from_other_machines, ["127.0.0.1", "::1", "localhost", "127.0.0.2"]))
    assert all(map(reachable_from_other_machines, ["0.0.0.0", "::", "10.0.0.5", "my-host"]))
    command = serve_command(["--model", "m", "--host", "0.0.0.0"])
    assert command[command.index("--middleware") + 1] == "trl_es.commands.vllm_serve.TokenMiddleware"


@pytest.mark.parametrize(
    "payload, field",
    [
        ("not json", "JSON"),
        ("[1, 2]", "object"),
        ({"seed": "1", "scale": 0.1}, "seed"),
        ({"seed": 1, "scale": float("nan")}, "scale"),
        ({"seed": 1, "scale": 0.1, "names": "w"}, "names"),
        ({"seed": 1, "scale": 0.1, "extra": 1}, "extra"),
        ({"seed": 1}, "scale"),
        ({"coefficients": [[1, 0.5]] * 70_000}, "coefficients"),
        ({"coefficients": [["1", 0.5]]}, "coefficients"),
        ({"coefficients": [[1, 0.5]], "decay": -1.0}, "decay"),
        ({"seed": 1, "noise_table_size": 10, "dtype": "float32", "names": ["w"]}, "noise_table_size"),
        ({"seed": 1, "noise_table_size": 2**24, "dtype": "int8", "names": ["w"]}, "dtype"),
        ({"seed": 1, "noise_table_size": 2**24, "dtype": "float32", "names": ["w"], "path": "/nonexistent"}, "path"),
    ],
)
def test_the_worker_refuses_malformed_arguments_naming_them(payload, field):
    required = {"scale": ("seed", "scale"), "coefficients": ("coefficients",), "noise_table_size": ("seed",)}
    needs = next((fields for key, fields in required.items() if isinstance(payload, dict) and key in payload), ())
    needs = ("seed", "scale") if field == "scale" else needs
    text = payload if isinstance(payload, str) else json.dumps(payload)
    with pytest.raises(ValueError, match=field):
        parse_payload(text, *needs)


def test_well_formed_arguments_pass():
    assert parse_payload(json.dumps({"seed": 3, "scale": -0.02, "names": None}), "seed", "scale")["seed"] == 3
    assert parse_payload(json.dumps({"coefficients": [[1, 0.5], [2, -1e-3]], "decay": 0.0}), "coefficients")
