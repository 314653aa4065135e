"""TRL's agent examples with ESTrainer in place of GRPOTrainer (examples/openenv/): an in-process 2048 game and
OpenEnv's echo environment served on 127.0.0.1 by the `openenv` package, both on SmolLM2 with a few-shot prompt.
Tool calls reach the game and the server, and the rewards the environments give come back into the run's log; the
echo example talks only to the server it started, and stops it on SIGTERM."""

import contextlib
import http.server
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from helpers import REPOSITORY, free_port


pytestmark = pytest.mark.slow


def example(name):
    spec = importlib.util.spec_from_file_location(
        f"openenv_{name}", REPOSITORY / "examples" / "openenv" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def logged(trainer, environment):
    return [log for log in trainer.state.log_history if f"rewards/{environment}/mean" in log]


def test_2048_game_receives_moves_and_its_scores_are_the_reward(tmp_path):
    game = example("game_2048")
    argv = ["--steps", "1", "--population", "2", "--max-completion-length", "64"]
    options = game.parse_args([*argv, "--output-dir", str(tmp_path)])
    trainer = game.make_trainer(options)
    trainer.train()
    (log,) = logged(trainer, "Game2048")
    games = trainer.agents.pool[None]
    assert len(games) == 2 * 2 * options.num_generations  # population × (prompts × 2 accumulated) × generations
    assert log["tools/call_frequency"] > 0 and sum(g.calls for g in games) > 0
    scores = [g.get_reward() for g in games]  # one game per episode of the step: every member's
    assert log["rewards/Game2048/mean"] == pytest.approx(sum(scores) / len(scores))
    assert all(score % 2 == 0 for score in scores)  # merged tiles' sums
    assert f"tool calls in {len(games)} games" in game.summary(trainer)


def test_echo_server_answers_tool_calls_and_its_rewards_come_back(tmp_path, monkeypatch):
    pytest.importorskip("openenv")
    echo = example("echo")
    argv = ["--steps", "1", "--population", "2", "--max-completion-length", "40", "--output-dir", str(tmp_path)]
    options = echo.parse_args(argv)
    monkeypatch.setattr(sys, "path", list(sys.path))  # `serve` puts the generated echo_env on the path
    monkeypatch.setenv("ECHO_ENV_URL", "")  # and sets the server's address
    try:
        with echo.serve(str(tmp_path), 0, echo.episodes_per_step(options) + 2):
            trainer = echo.make_trainer(options)
            trainer.train()
            (log,) = logged(trainer, "EchoToolEnv")
            sessions = trainer.agents.pool[None]
            served = sum(env.client.state().step_count for env in sessions)
            assert served == sum(env.calls for env in sessions) > 0  # every tool call reached the server
            assert log["tools/call_frequency"] > 0 and log["rewards/EchoToolEnv/mean"] > 0
            rewards = [env.get_reward() for env in sessions]
            assert log["rewards/EchoToolEnv/mean"] == pytest.approx(sum(rewards) / len(rewards))
    finally:
        for name in [m for m in sys.modules if m == "echo_env" or m.startswith("echo_env.")]:
            del sys.modules[name]


def run_echo(*flags, **popen) -> subprocess.Popen:
    """examples/openenv/echo.py with `flags`, in a session of its own (so that the test can end what it left)."""
    command = [
        sys.executable,
        str(REPOSITORY / "examples" / "openenv" / "echo.py"),
        "--serve",
        "--steps",
        "50",
        *flags,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    return subprocess.Popen(command, env=env, start_new_session=True, text=True, **popen)


def answers(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/health", timeout=2)
    except OSError:
        return False
    return True


def test_echo_trains_only_against_the_server_it_started(tmp_path, tiny_model_dir):
    """A process already answering /health on the port (a squatter, which could set every reward) is refused before
    the example talks to it; the example's own server could not have started there."""
    pytest.importorskip("openenv")
    asked = []

    class Squatter(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            self.send_response(200), self.end_headers()

    squatter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Squatter)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    port = squatter.server_address[1]
    echo = run_echo(
        "--port", str(port), "--model", tiny_model_dir, "--output-dir", str(tmp_path), stderr=subprocess.PIPE
    )
    try:
        _, err = echo.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(echo.pid, signal.SIGKILL)
        squatter.shutdown()
    assert echo.returncode != 0 and f"port {port} is taken" in err, err[-2000:]
    assert asked == []


def test_echo_stops_its_server_on_sigterm(tmp_path, tiny_model_dir):
    """A SIGTERM (a job scheduler's stop) runs the example's clean-up: its server stops listening, where it would be
    the squatter of the next run."""
    pytest.importorskip("openenv")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    echo = run_echo("--port", str(port), "--model", tiny_model_dir, "--output-dir", str(tmp_path))
    try:
        deadline = time.monotonic() + 240
        while not answers(url) and echo.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert answers(url), "the echo server did not start"
        echo.send_signal(signal.SIGTERM)
        assert echo.wait(timeout=120) != 0
        assert not answers(url)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(echo.pid, signal.SIGKILL)
