"""TRL's OpenEnv echo example (an environment served over WebSocket, wrapped by an `environment_factory` class) with
ESTrainer in place of GRPOTrainer.

    pip install openenv==0.10.0
    python examples/openenv/echo.py --model smollm2 --serve  # starts the echo server on 127.0.0.1 itself, on a
                                                             # free port (--port P: on P, refused if it is taken)

or with a server of your own (`ECHO_ENV_URL`, and the folder holding `echo_env` on PYTHONPATH):

    openenv init echo_env  # OpenEnv's template is the echo environment; raise max_concurrent_envs in server/app.py
    PYTHONPATH=. python -m uvicorn echo_env.server.app:app --host 127.0.0.1 --port 8001
    ECHO_ENV_URL=http://127.0.0.1:8001 PYTHONPATH=. python examples/openenv/echo.py --model smollm2

The server echoes each message and rewards its length (0.1 a character, at most 1). Each environment instance holds
one server session (a WebSocket); ES plays population × prompts × generations episodes a step, one instance each, so
the server's `max_concurrent_envs` (1 in the template) must be at least that: a client beyond it is refused with
CAPACITY_REACHED. What changes from TRL's script for ES on CPU: `ESConfig.from_grpo_config` on the GRPOConfig (plus
the ES fields), bf16 off, no vLLM, a small model sampled at T=0.7. SmolLM2 ships no tool template (it gets TRL's
Qwen2.5 one), and it calls `echo` only after worked examples: the prompt opens with a system message and three of
them. The tool answers with the reward rather than the echo (with the echo in the examples, SmolLM2 writes the
answer itself instead of calling the tool).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


SYSTEM = "You talk to an environment: call the echo tool."
PROMPT = "Send a message with the echo tool."
WORKED = ["Good morning", "ES works", "Hi there"]  # the messages of the worked examples


def server_reward(message: str) -> float:
    """The echo server's reward for `message`."""
    return min(len(message) * 0.1, 1.0)


def few_shot() -> list[dict]:
    """The system message and three worked examples: call `echo`, read the reward, stop."""
    messages = [{"role": "system", "content": SYSTEM}]
    for message in WORKED:
        call = {"type": "function", "function": {"name": "echo", "arguments": {"message": message}}}
        messages += [
            {"role": "user", "content": PROMPT},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "echo", "content": f"reward {server_reward(message):.1f}"},
            {"role": "assistant", "content": "Done."},
        ]
    return messages


class EchoToolEnv:
    """One session on the echo server at `ECHO_ENV_URL` per instance: `reset` starts an episode there (given the
    episode's seed, as trl-es passes it), the tool `echo` sends a message, `get_reward` is the server's reward for
    the last one. `calls` counts the messages sent in the episode."""

    def __init__(self):
        from echo_env import EchoEnv

        self.client = EchoEnv(base_url=os.environ["ECHO_ENV_URL"])
        self.reward, self.calls = 0.0, 0

    def reset(self, seed=None, **row) -> None:
        self.client.reset(seed=seed)
        self.reward, self.calls = 0.0, 0

    def echo(self, message: str) -> str:
        """Send a message to the environment, which echoes it back.

        Args:
            message: The message to send.

        Returns:
            The reward the environment gave the message.
        """
        from echo_env.models import EchoAction

        self.calls += 1
        result = self.client.step(EchoAction(message=str(message)))
        self.reward = result.reward or 0.0
        return f"reward {self.reward:.1f}"

    def get_reward(self) -> float:
        return self.reward


@contextlib.contextmanager
def serve(folder: str, port: int, max_concurrent_envs: int):
    """OpenEnv's echo template written into `folder` by `openenv init` (with `max_concurrent_envs` sessions), served
    by uvicorn on 127.0.0.1:`port` (0: a free one) until the block ends; yields the server process once its /health
    answers, `echo_env` importable here and `ECHO_ENV_URL` set. The port is bound here and handed to uvicorn, and
    held until the server stopped: no other process answers there, so the run talks to the server it started only."""
    try:
        listening = socket.create_server(("127.0.0.1", port))
    except OSError as error:
        raise SystemExit(f"echo.py: port {port} is taken ({error.strerror}): choose another --port, or leave it out "
                         "for a free one") from None  # fmt: skip
    with listening:
        if not os.path.isdir(os.path.join(folder, "echo_env")):
            subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env"], cwd=folder, check=True)
        app = os.path.join(folder, "echo_env", "server", "app.py")
        with open(app) as file:
            source = file.read()
        with open(app, "w") as file:
            file.write(source.replace("max_concurrent_envs=1,", f"max_concurrent_envs={max_concurrent_envs},"))
        descriptor = listening.fileno()
        command = [sys.executable, "-m", "uvicorn", "echo_env.server.app:app", "--fd", str(descriptor)]
        server = subprocess.Popen(command, cwd=folder, env={**os.environ, "PYTHONPATH": folder}, pass_fds=[descriptor])
        try:
            url = f"http://127.0.0.1:{listening.getsockname()[1]}"
            wait_for_health(server, url)
            sys.path.insert(0, folder)
            os.environ["ECHO_ENV_URL"] = url
            yield server
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def wait_for_health(server: subprocess.Popen, url: str) -> None:
    """Return once `server`'s /health at `url` answers; a RuntimeError if it exits or takes over 60 s."""
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return
        except OSError:
            if server.poll() is not None:
                raise RuntimeError(f"the echo server exited with {server.returncode}") from None
            time.sleep(0.5)
    raise RuntimeError(f"the echo server did not answer on {url} within 60 s")


def tool_tokenizer(model: str):
    """The model's tokenizer; TRL's Qwen2.5 template where its own cannot call tools (SmolLM2's)."""
    import trl
    from transformers import AutoTokenizer
    from trl.chat_template_utils import supports_tool_calling

    from trl_es.util.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    if not supports_tool_calling(tokenizer):
        with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen2_5.jinja")) as template:
            tokenizer.chat_template = template.read()
    return tokenizer


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a model directory, a Hub id, or 'smollm2'")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--population", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=1, help="per_device_train_batch_size (×2 accumulation)")
    parser.add_argument("--num-generations", type=int, default=2)
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--serve", action="store_true", help="start the echo server here (else: ECHO_ENV_URL)")
    parser.add_argument("--port", type=int, default=0, help="the port of the server --serve starts (0: a free one)")
    parser.add_argument("--output-dir", default="outputs/openenv-echo")
    return parser.parse_args(argv)


def episodes_per_step(options) -> int:
    """The episodes an ES step plays (population × prompts × 2 accumulated × generations): one session each."""
    return options.population * options.prompts * 2 * options.num_generations


def make_trainer(options):
    """The ESTrainer of TRL's echo script for the parsed command line `options` (the server already running)."""
    from datasets import Dataset
    from trl import GRPOConfig
    from trl.trainer.utils import remove_none_values

    from trl_es import ESConfig, ESTrainer

    dataset = Dataset.from_dict({"prompt": [[*few_shot(), {"role": "user", "content": PROMPT}]] * 64})
    # Arrow gives every message every key (`tool_calls: None` on plain ones); TRL's helper drops them again
    dataset = dataset.with_transform(remove_none_values)
    grpo_args = GRPOConfig(
        output_dir=options.output_dir,
        bf16=False,  # CPU
        use_vllm=False,  # CPU
        chat_template_kwargs={"enable_thinking": False},
        log_completions=True,
        logging_steps=1,
        num_completions_to_print=1,
        report_to="none",
        max_completion_length=options.max_completion_length,
        per_device_train_batch_size=options.prompts,
        gradient_accumulation_steps=2,
        num_generations=options.num_generations,
        temperature=0.7,
        max_steps=options.steps,
        save_strategy="no",
        disable_tqdm=True,
    )
    args = ESConfig.from_grpo_config(grpo_args, population_size=options.population, sigma=5e-3, learning_rate=5e-3)
    return ESTrainer(
        model=options.model,
        args=args,
        train_dataset=dataset,
        processing_class=tool_tokenizer(options.model),
        environment_factory=EchoToolEnv,
    )


def summary(trainer) -> str:
    """Each logged step's mean reward and tool-call frequency, and what the server counted in the last step."""
    lines = [
        f"step {log['step']}: mean reward {log['rewards/EchoToolEnv/mean']:.3f}, "
        f"tool calls per episode {log['tools/call_frequency']:.2f}"
        for log in trainer.state.log_history
        if "rewards/EchoToolEnv/mean" in log
    ]
    sessions = trainer.agents.pool[None]
    served = sum(env.client.state().step_count for env in sessions)
    lines.append(f"last step: the server answered {served} echo calls over {len(sessions)} sessions")
    return "\n".join(lines)


def main(argv=None):
    import tempfile

    start = time.time()
    options = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # clean up, as after Ctrl-C
    with tempfile.TemporaryDirectory() as folder:
        with (
            serve(folder, options.port, episodes_per_step(options) + 2) if options.serve else contextlib.nullcontext()
        ):
            trainer = make_trainer(options)
            trainer.train()
            print(summary(trainer))
    print(f"total {time.time() - start:.0f}s")


if __name__ == "__main__":
    main()
