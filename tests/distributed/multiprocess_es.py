"""A user script calling ESTrainer, launched by the multi-process tests with `accelerate launch` (`main` is called
in the test process for the 1-process reference).

    [ES_TEST_FAULT=raise|hang|kill] python multiprocess_es.py MODEL_DIR OUT_DIR '{"max_steps": 3, ...}'

Trains the tiny model on the counting prompts with `upper_vocab_share` (greedy) and writes the model (main process)
and, per process, `weights-rank{r}.pt` (every parameter) and `result-rank{r}.json` (log history, or the error and
whether θ was restored). ES_TEST_FAULT makes process 1 misbehave at step 1: `raise` (its reward function raises),
`hang` (it sleeps past `ddp_timeout`), `kill` (it kills itself with SIGKILL).
"""

import contextlib
import json
import os
import signal
import sys
import time

import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_es import ESConfig, ESTrainer


FAULT = os.environ.get("ES_TEST_FAULT")


def upper_vocab_share(completion_ids, trainer_state, **kwargs):
    """Share of completion tokens from the upper half of the vocabulary; process 1 misbehaves when asked."""
    rank = int(os.environ.get("RANK", "0"))
    if FAULT and rank == 1 and trainer_state.global_step == 1:
        if FAULT == "raise":
            raise RuntimeError("reward server unreachable")
        if FAULT == "hang":
            time.sleep(60)
        if FAULT == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    return [sum(t >= 24576 for t in ids) / max(len(ids), 1) for ids in completion_ids]


class StepStartWeights(TrainerCallback):
    """Keeps θ as it was at the start of the latest step, to check restoring after a failure."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.weights = {n: p.detach().clone() for n, p in model.named_parameters()}


def main(model_dir: str, out_dir: str, overrides: dict) -> dict:
    prompts = [f"Count to {n}:" for n in range(1, 9)]
    dataset = Dataset.from_dict({"prompt": prompts})
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
        model_dir, upper_vocab_share, args=args, train_dataset=dataset, eval_dataset=dataset, callbacks=[watcher]
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


if __name__ == "__main__":
    if "error" in main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])):
        # Leave without the interpreter's teardown: after a peer hung, torch.distributed's shutdown waits ~3 min for
        # it (measured), which says nothing about ES. The error and the weights are already written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
