"""TRL's agent examples with ESTrainer in place of GRPOTrainer (examples/openenv/): an in-process 2048 game and
OpenEnv's echo environment served on 127.0.0.1 by the `openenv` package, both on SmolLM2 with a few-shot prompt.
Tool calls reach the game and the server, and the rewards the environments give come back into the run's log."""

import importlib.util
import sys

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
    server = echo.serve(str(tmp_path), free_port(), echo.episodes_per_step(options) + 2)
    try:
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
        server.terminate()
        server.wait()
        for name in [m for m in sys.modules if m == "echo_env" or m.startswith("echo_env.")]:
            del sys.modules[name]
