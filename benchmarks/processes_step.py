"""The same ES step with 1 and with 2 CPU processes (Accelerate, gloo), and the bytes the processes exchange.

    python benchmarks/processes_step.py [--population 8] [--prompts 8] [--tokens 32] [--steps 2]

Runs the same seeded ES training on SmolLM2-135M-Instruct fp32 in fresh processes: as one plain process (torch
uses both cores), as one process with one thread, as 2 processes under `accelerate launch --multi_gpu` (one thread
each, as Accelerate sets), and as 2 processes under DeepSpeed ZeRO-3 (`examples/accelerate/deepspeed_zero3.yaml`).
Reports the wall time of the last step (the first includes one-off allocations), the bytes each process sent
through torch.distributed collectives in that step, the peak RSS per process, the gradients and optimizer state
allocated, and whether the final weights are bitwise equal. Prints one table; ratios are within this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def reward(completions, **kwargs):
    """Characters in the completion: any reward does for timing, as long as members differ."""
    return [float(len(c[0]["content"])) for c in completions]


def count_collective_bytes(counter: dict) -> None:
    """Wrap torch.distributed's collectives to add the bytes of the tensor each one sends to `counter["bytes"]`."""
    import torch.distributed as dist

    sent_tensor = {  # collective: (position, keyword) of the tensor this process contributes
        "all_reduce": (0, "tensor"),
        "broadcast": (0, "tensor"),
        "all_gather": (1, "tensor"),
        "all_gather_into_tensor": (1, "input_tensor"),
    }
    for name, (position, keyword) in sent_tensor.items():
        original = getattr(dist, name)

        def wrapped(*args, _original=original, _position=position, _keyword=keyword, **kwargs):
            tensor = args[_position] if len(args) > _position else kwargs[_keyword]
            counter["bytes"] += tensor.numel() * tensor.element_size()
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)


def worker(options, out_dir: str) -> None:
    """One process of the run: train `options.steps` steps, write this process's measurements."""
    import torch
    from transformers import TrainerCallback

    from trl_es import ESConfig, ESTrainer
    from trl_es.tasks import small_sums
    from trl_es.util.models import smollm2_dir

    counter = {"bytes": 0}
    count_collective_bytes(counter)

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start, self.bytes_at_start = time.perf_counter(), counter["bytes"]

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds, self.bytes = time.perf_counter() - self.start, counter["bytes"] - self.bytes_at_start

    args = ESConfig(
        output_dir=out_dir,
        population_size=options.population,
        per_device_train_batch_size=options.prompts,
        max_completion_length=options.tokens,
        generation_kwargs={"min_new_tokens": options.tokens},
        max_steps=options.steps,
        sigma=1e-3,
        seed=0,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
    )
    clock = StepClock()
    trainer = ESTrainer(smollm2_dir(), reward, args=args, train_dataset=small_sums("train"), callbacks=[clock])
    trainer.train()
    rank = trainer.accelerator.process_index
    result = {
        "step_seconds": clock.seconds,
        "step_bytes": clock.bytes,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threads": torch.get_num_threads(),
        # ES allocates no gradients and no optimizer state, under DeepSpeed either
        "gradients": sum(p.grad is not None for p in trainer.model.parameters()),
        "optimizer_state": len(trainer.optimizer.state),
        "engine_optimizer": type(getattr(trainer.model_wrapped, "optimizer", None)).__name__,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.save({n: p.detach() for n, p in trainer.model.named_parameters()}, os.path.join(out_dir, f"w{rank}.pt"))


def run(num_processes: int, options, out_dir: str, threads: int | None = None, zero3: bool = False) -> list[dict]:
    script = [str(Path(__file__).resolve()), "--worker", out_dir, *sys.argv[1:]]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    if num_processes == 1:
        command = [sys.executable, *script]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        backend = ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]
        if zero3:
            backend = ["--config_file", str(ROOT / "examples" / "accelerate" / "deepspeed_zero3.yaml")]
            env |= {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(ROOT / "build" / "torch_extensions")}
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            *backend,
            "--num_processes",
            str(num_processes),
            "--num_machines",
            "1",
            "--main_process_port",
            str(port),
            *script,
        ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(num_processes)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options, _ = parser.parse_known_args()
    if options.worker:
        return worker(options, options.worker)

    import torch

    with tempfile.TemporaryDirectory() as scratch:
        folders = [tempfile.mkdtemp(dir=scratch) for _ in range(4)]
        single, pair = run(1, options, folders[0]), run(2, options, folders[1])
        single_thread, zero3 = run(1, options, folders[2], threads=1), run(2, options, folders[3], zero3=True)
        reference = torch.load(Path(folders[0]) / "w0.pt")
        same = all(  # (ZeRO-3 leaves θ partitioned; its equality is tested in tests/distributed/test_multiprocess.py)
            torch.equal(reference[name], weights[name])
            for folder in folders[1:3]
            for weights in [torch.load(Path(folder) / "w0.pt")]
            for name in reference
        )
    n = options.population
    print(
        f"ES step on SmolLM2-135M fp32, CPU: N={n}, {options.prompts} prompts × {options.tokens} tokens, "
        f"last of {options.steps} steps"
    )
    print(f"{'':24} {'s/step':>8} {'bytes sent/step/process':>24} {'peak RSS MB/process':>20} {'threads':>8}")
    rows = (
        ("1 process", single),
        ("1 process, 1 thread", single_thread),
        ("2 processes (gloo)", pair),
        ("2 processes, ZeRO-3", zero3),
    )
    for label, results in rows:
        seconds = max(r["step_seconds"] for r in results)
        sent = max(r["step_bytes"] for r in results)
        rss = max(r["peak_rss"] for r in results) / 2**20
        print(f"{label:24} {seconds:8.1f} {sent:24d} {rss:20.0f} {results[0]['threads']:8d}")
    ratio = max(r["step_seconds"] for r in pair) / single[0]["step_seconds"]
    print(f"2 processes / 1 process wall time: {ratio:.2f} (target ≤ 0.60)")
    per_thread = max(r["step_seconds"] for r in pair) / single_thread[0]["step_seconds"]
    thread_speedup = single_thread[0]["step_seconds"] / single[0]["step_seconds"]
    print(
        f"2 processes / 1 process at one thread per process: {per_thread:.2f} (ideal 0.50); the ratio above is "
        f"this times the speed-up torch gets from a second thread in one process ({thread_speedup:.2f})"
    )
    print(
        f"bytes per step: {max(r['step_bytes'] for r in pair)} = 8 × (slots × summary width + processes); "
        f"N = {n} members: O(N) scalars, never weights"
    )
    print("ZeRO-3 bytes include the all-gather of θ for generation, once per step, as in GRPO")
    allocated = {k: max(r[k] for r in single + pair + zero3) for k in ("gradients", "optimizer_state")}
    print(
        f"gradients allocated: {allocated['gradients']}, optimizer state entries: {allocated['optimizer_state']}, "
        f"DeepSpeed engine optimizer under ZeRO-3: {zero3[0]['engine_optimizer']} (partitions parameters only)"
    )
    print(f"final weights bitwise equal (1 process; 2 processes; 1 process at 1 thread): {same}")


if __name__ == "__main__":
    main()
