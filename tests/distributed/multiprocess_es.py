"""The one launched harness: runs, one after the other in the same processes, launched by the distributed tests with
`accelerate launch` (or called in the test process for the 1-process reference).

    python multiprocess_es.py OUT_DIR '[{"name": "logged", "model": DIR, "overrides": {...}}, ...]'

Each run is either a regression-guard scenario (`{"guard": "full", "models": DIR}`: its final weights' hash into
OUT_DIR/hashes-rank{r}.json) or a user script calling ESTrainer (`train`): the tiny model on the counting prompts
with `upper_vocab_share` (greedy), writing OUT_DIR/<name>/ — the model (main process), `weights-rank{r}.pt` (every
parameter) and `result-rank{r}.json` (log history, or the error and whether θ was restored). A run's `fault` makes
process 1 misbehave at step 1: `raise` (its reward function raises), `hang` (it sleeps past `ddp_timeout`), `kill`
(it kills itself with SIGKILL). A run with `"quantized": true` trains a LoRA adapter on the model loaded in 8 bits
by bitsandbytes (QLoRA), one with `"qes": true` the int8 weights of that 8-bit model themselves (QES: its overrides
name the space); one with `"vlm": true` trains a vision-language model on the prompts as conversations, each
with a picture of its own shade. A failing run must come last: the processes leave after it.
"""

import contextlib
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

import regression_guard  # registers the guard's search space before any trainer is built; vLLM's CPU settings
import torch
from datasets import Dataset
from helpers import accelerate_launch, solid_image
from transformers import TrainerCallback

from trl_es import ESConfig, ESTrainer


FAULT = {"fault": None}  # the running run's fault


def upper_vocab_share(completion_ids, trainer_state, **kwargs):
    """Share of completion tokens from the upper half of the vocabulary; process 1 misbehaves when asked."""
    rank, fault = int(os.environ.get("RANK", "0")), FAULT["fault"]
    if fault and rank == 1 and trainer_state.global_step == 1:
        if fault == "raise":
            raise RuntimeError("reward server unreachable")
        if fault == "hang":
            time.sleep(15)  # past ddp_timeout and the others' wait for it to answer (`unanswering`)
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    return [sum(t >= 24576 for t in ids) / max(len(ids), 1) for ids in completion_ids]


class StepStartWeights(TrainerCallback):
    """Keeps θ as it was at the start of the latest step, to check restoring after a failure."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.weights = {n: p.detach().clone() for n, p in model.named_parameters()}


def eight_bits():
    """bitsandbytes' 8-bit quantization (LLM.int8, CPU)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True)


def quantized_adapter() -> dict:
    """ESTrainer's arguments for a LoRA adapter on an 8-bit base (bitsandbytes, CPU)."""
    from peft import LoraConfig

    adapter = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    return {"quantization_config": eight_bits(), "peft_config": adapter}


def shaded(prompts: list[str]) -> Dataset:
    """The prompts as conversations, prompt k with a grey picture of level 32·k (a vision-language model's data)."""
    images = [solid_image(32 * k) for k in range(len(prompts))]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts], "image": images})


def train(
    model_dir: str, out_dir: str, overrides: dict, fault: str | None = None, quantized=False, vlm=False, qes=False
) -> dict:
    """The user script's run into `out_dir`; its result (also written there, per process)."""
    FAULT["fault"] = fault
    prompts = [f"Count to {n}:" for n in range(1, 9)]
    dataset = shaded(prompts) if vlm else Dataset.from_dict({"prompt": prompts})
    values = dict(
        output_dir=out_dir,
        population_size=5,
        es_baseline="center",
        sigma=0.01,
        learning_rate=0.01,
        per_device_train_batch_size=4,
        num_generations=1,
        max_completion_length=6,
        generation_kwargs={"do_sample": False},
        max_steps=3,
        seed=0,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        # evaluation at the last step, one prompt per generate call, and the optional step logs
        eval_strategy="steps",
        eval_steps=3,
        per_device_eval_batch_size=1,
        success_threshold=0.2,
        log_population_diversity=True,
        log_completion_entropy=True,
    )
    resume = overrides.pop("resume_from_checkpoint", None)
    args = ESConfig(**{**values, **overrides})
    watcher = StepStartWeights()
    trainer = ESTrainer(
        model_dir,
        upper_vocab_share,
        args=args,
        train_dataset=dataset,
        eval_dataset=dataset,
        callbacks=[watcher],
        **(quantized_adapter() if quantized else {}),
        **({"quantization_config": eight_bits()} if qes else {}),
    )
    rank = trainer.accelerator.process_index
    result = {"num_processes": trainer.accelerator.num_processes}
    try:
        trainer.train(resume_from_checkpoint=resume)
        trainer.save_model()
        result["log_history"] = trainer.state.log_history
        # ES allocates no gradients and no optimizer state, under DeepSpeed too
        result["gradients"] = sum(p.grad is not None for p in trainer.model.parameters())
        result["optimizer_state"] = len(trainer.optimizer.state)
        result["engine_optimizer"] = type(getattr(trainer.model_wrapped, "optimizer", None)).__name__
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
        start = getattr(watcher, "weights", None)  # None: it failed before the first step
        params = trainer.model.named_parameters()
        result["restored"] = start is not None and all(torch.equal(p, start[n]) for n, p in params)
    params = dict(trainer.model.named_parameters())
    result["zero3_partitioned"] = zero3 = hasattr(next(iter(params.values())), "ds_id")
    gathered = contextlib.nullcontext()
    if zero3:  # θ is partitioned across the processes: gather it to compare it
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(params.values()))
    with gathered:
        torch.save({n: p.detach().clone() for n, p in params.items()}, f"{out_dir}/weights-rank{rank}.pt")
    with open(f"{out_dir}/result-rank{rank}.json", "w") as f:
        json.dump(result, f)
    return result


def tensor_parallel_members(model_dir: str, out_dir: str, tp: int = 2) -> dict:
    """bf16 members through a tensor-parallel vLLM engine: on each rank, the shard vLLM holds of members of two
    seeds is the bfloat16 cast of that region of the trainer's θ + σ·ε, bitwise; then 2 ES steps, saved with their
    chain (the test replays it)."""
    from regression_guard import PROMPTS, reward

    from trl_es.es.weights import weights_hash

    args = ESConfig(output_dir=out_dir, use_vllm=True, vllm_tensor_parallel_size=tp, bf16=True, use_cpu=True,
                    population_size=4, sigma=0.02, learning_rate=0.02, per_device_train_batch_size=8,
                    max_completion_length=6, max_steps=2, generation_kwargs={"do_sample": False}, save_strategy="no",
                    report_to="none", disable_tqdm=True, seed=0)  # fmt: skip
    trainer = ESTrainer(model_dir, reward, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    weights, rank = trainer.weights, trainer.accelerator.process_index
    weights.start()
    weights.capture()
    worker = trainer.generation.engine.llm.llm_engine.model_executor.driver_worker.worker._es.weights
    result = {"sharded": sorted(worker.regions), "members_equal": [], "in_place": weights.members_in_place}
    for seed in (5, 77):
        weights.member(seed, 0.02)
        weights.local.member(seed, 0.02)  # the trainer's float32 member
        held = {n: worker.regions[n].cut(p) if n in worker.regions else p for n, p in weights.params.items()}
        result["members_equal"].append(
            all(torch.equal(p.detach().bfloat16(), worker.params[n]) for n, p in held.items())
        )
        weights.center()
        weights.local.center()
    weights.release()
    trainer.train()
    trainer.save_model()
    result["weights"] = weights_hash(dict(trainer.model.named_parameters()))
    Path(out_dir, f"result-rank{rank}.json").write_text(json.dumps(result))
    return result


def guard_runs(
    models: Path, vllm: bool = False, scenarios=tuple(regression_guard.SCENARIOS), tp: int = 1
) -> list[dict]:
    """Guard scenarios to run (`vllm`: through a colocated engine of `tp` tensor-parallel processes)."""
    return [{"guard": scenario, "models": str(models), "vllm": vllm, "tp": tp} for scenario in scenarios]


def launch(out: Path, runs: list[dict], num_processes: int = 2, timeout: float = 900, **options):
    """The harness launched with `num_processes` processes; the completed process."""
    out.mkdir(parents=True, exist_ok=True)
    script = Path(__file__)
    return accelerate_launch(num_processes, str(script), str(out), json.dumps(runs), timeout=timeout, **options)


def rank_hashes(out: Path, num_processes: int = 2) -> dict[str, str]:
    """The guard hashes every process wrote; they must agree."""
    ranks = [json.loads((out / f"hashes-rank{r}.json").read_text()) for r in range(num_processes)]
    assert all(rank == ranks[0] for rank in ranks)  # every process ends with the same weights
    return ranks[0]


def main(out_dir: str, runs: list[dict]) -> bool:
    """Every run in order; False after the first that failed (the runs after it are not started)."""
    out, hashes, rank = Path(out_dir), {}, os.environ.get("RANK", "0")
    group, ok = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None, True
    for run in runs:
        if "guard" in run:
            tp = run.get("tp", 1)
            extra = {"use_vllm": True, "vllm_tensor_parallel_size": tp} if run.get("vllm") else {}
            key = run["guard"] if tp == 1 else f"{run['guard']}@tp{tp}"
            hashes[key] = regression_guard.run(run["guard"], Path(run["models"]), out / f"guard-tp{tp}", **extra)
        elif "tp_members" in run:
            tensor_parallel_members(run["model"], str(out / run["name"]), run["tp_members"])
        else:
            folder = out / run["name"]
            folder.mkdir(parents=True, exist_ok=True)
            overrides, fault, quantized = dict(run.get("overrides", {})), run.get("fault"), run.get("quantized", False)
            vlm, qes = run.get("vlm", False), run.get("qes", False)
            ok = "error" not in train(run["model"], str(folder), overrides, fault, quantized, vlm, qes)
        gc.collect()  # a finished trainer's vLLM engine shuts down here, not inside the next run
        world = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
        assert world is group, f"after {run}: the process group accelerate made was destroyed"
        if not ok:
            break
    (out / f"hashes-rank{rank}.tmp").write_text(json.dumps(hashes, indent=1))
    os.replace(out / f"hashes-rank{rank}.tmp", out / f"hashes-rank{rank}.json")  # whole, or not there
    if not ok and run.get("fault") == "raise":
        wait_for_peers(out)
    return ok


def wait_for_peers(out: Path, seconds: float = 60):
    """After a run every process failed alike, each waits (up to `seconds`) until every process has written its
    files: the launcher ends the others as soon as one exits, which could cut a peer's writes short."""
    ranks = range(int(os.environ.get("WORLD_SIZE", "1")))
    deadline = time.monotonic() + seconds
    while not all((out / f"hashes-rank{r}.json").is_file() for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)


if __name__ == "__main__":
    from accelerate import PartialState

    PartialState()  # accelerate's process group, launched with several processes
    gc.freeze()  # the libraries' objects out of each run's full collections (tests/conftest.py says why)
    if not main(sys.argv[1], json.loads(sys.argv[2])):
        # Leave without the interpreter's teardown: after a peer hung, torch.distributed's shutdown waits ~3 min for
        # it (measured), which says nothing about ES. The error and the weights are already written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
