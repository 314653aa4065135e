"""`trl-es diagnose`: does a centre baseline, antithetic pairs or common random numbers lower the variance of ES here?

    trl-es diagnose --model smollm2 --task small_sums --sigma 1e-3,3e-3,1e-2 --directions 16 \
        --coupling common,independent --objective reward,logprob --out outputs/diagnose

For each (objective, coupling, σ), over P random directions ε_d (each with its own batch of prompts and sampling
seeds): X0 = F(θ), X± = F(θ ± σε_d), then Corr(X+, X0), Corr(X+, X−), κ_base = Var(X+ − X0)/Var(X+) and
κ_pair = Var(X+ − X−)/Var(X+) with bootstrap intervals (`trl_es.research.diagnose`). Members are formed by the run's
own search space (`--search-space`: full, low-rank; an adapter with `--adapter-only` or `--lora-r`), as ESTrainer
forms them; θ is restored bitwise. Writes DIR/diagnose.json (one record per row) and DIR/diagnose.md (the table);
docs/diagnose.md says what to do with each outcome.
"""

from __future__ import annotations

import json
import os
import tempfile
from types import SimpleNamespace

from ..research.diagnose import COUPLINGS, OBJECTIVES, Probe, diagnose, prompt_batches, table
from ..tasks import TASKS, get_task
from ..util.atomic import atomic_write_text
from .parser import command_parser
from .train import load_datasets, load_reward_funcs


SPACES = ("full", "lowrank")
"""The search spaces whose members are directions ±ε (CoPES perturbs one group per member, Hyper-ES merges)."""


def choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    values = [value for value in text.split(",") if value]
    unknown = [value for value in values if value not in allowed]
    if unknown or not values:
        raise ValueError(f"{flag} takes a comma-separated list of {', '.join(allowed)}, got {text!r}")
    return values


def parse(argv: list[str] | None):
    parser = command_parser("trl-es diagnose", __doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="smollm2", help="a model id or directory ('smollm2': SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--task", default=None, help="the prompts (train split) and reward of a built-in task: "
                        + ", ".join(TASKS))  # fmt: skip
    parser.add_argument("--reward", default=None, help="comma-separated reward functions (registry names or dotted "
                        "paths) instead of the task's")  # fmt: skip
    parser.add_argument("--dataset", default=None, help="the prompts: a task name, local file or Hub dataset (its "
                        "train split) instead of the task's")  # fmt: skip
    parser.add_argument("--sigma", default="1e-3,3e-3,1e-2", help="comma-separated noise scales σ")
    parser.add_argument("--directions", type=int, default=16, help="P random directions ε_d")
    parser.add_argument("--prompts", type=int, default=4, help="prompts in each direction's batch")
    parser.add_argument("--num-generations", type=int, default=1, help="completions per prompt")
    parser.add_argument("--max-completion-length", type=int, default=16, help="tokens per completion")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts")
    parser.add_argument("--coupling", default=",".join(COUPLINGS), help="comma-separated, of " + ", ".join(COUPLINGS))
    parser.add_argument(
        "--objective", default=",".join(OBJECTIVES), help="comma-separated, of " + ", ".join(OBJECTIVES)
    )
    parser.add_argument("--search-space", default="full", choices=SPACES, help="what a member perturbs")
    parser.add_argument("--lowrank-rank", type=int, default=1, help="the rank r of low-rank members")
    parser.add_argument("--parameter-patterns", default=None, help="comma-separated regular expressions: perturb "
                        "only the matching parameters (es_parameter_patterns)")  # fmt: skip
    parser.add_argument("--adapter-only", action="store_true", help="--model is a PEFT adapter: perturb its weights")
    parser.add_argument("--lora-r", type=int, default=None, help="add a new LoRA adapter of this rank (peft's "
                        "default target modules) and perturb its weights")  # fmt: skip
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamplings of the directions")
    parser.add_argument("--seed", type=int, default=0, help="derives the directions, batches and sampling seeds")
    parser.add_argument("--out", default="outputs/diagnose", help="where diagnose.json and diagnose.md go")
    options = parser.parse_args(argv)
    if options.task is None and (options.reward is None or options.dataset is None):
        parser.error("give --task, or --reward with --dataset")
    if options.directions < 3:
        parser.error("--directions: the statistics need at least 3")
    return options


def main(argv: list[str] | None = None) -> list[dict]:
    options = parse(argv)
    sigmas = [float(s) for s in options.sigma.split(",") if s]
    objectives = choices(options.objective, OBJECTIVES, "--objective")
    couplings = choices(options.coupling, COUPLINGS, "--coupling")
    task = get_task(options.task) if options.task else None
    reward_funcs = load_reward_funcs(options.reward.split(",")) if options.reward else [task.reward]
    if options.dataset is None:
        dataset = task.load("train")
    else:
        script = SimpleNamespace(dataset_name=options.dataset, dataset_config=None, dataset_streaming=False)
        dataset = load_datasets(script, SimpleNamespace(datasets=None))["train"]
    batches = prompt_batches(len(dataset), options.directions, options.prompts, options.seed)

    from .. import ESConfig, ESTrainer

    peft_config = None
    if options.lora_r is not None:
        from peft import LoraConfig

        peft_config = LoraConfig(r=options.lora_r, task_type="CAUSAL_LM")
    with tempfile.TemporaryDirectory() as scratch:  # the trainer's output_dir: it trains nothing
        args = ESConfig(
            output_dir=scratch,
            population_size=2,
            sigma=max(sigmas),
            learning_rate=max(sigmas),  # no update is taken; α of the order of σ keeps ESConfig's α check quiet
            per_device_train_batch_size=options.prompts,
            num_generations=options.num_generations,
            max_completion_length=options.max_completion_length,
            temperature=options.temperature,
            seed=options.seed,
            es_search_space=options.search_space,
            lowrank_rank=options.lowrank_rank,
            es_parameter_patterns=options.parameter_patterns.split(",") if options.parameter_patterns else None,
            es_adapter_only=options.adapter_only,
            report_to="none",
            disable_tqdm=True,
        )
        trainer = ESTrainer(options.model, reward_funcs, args=args, train_dataset=dataset, peft_config=peft_config)
        probe = Probe.of(trainer, options.seed)
        rows = [[dataset[i] for i in batch] for batch in batches]
        records = diagnose(probe, rows, sigmas, objectives, couplings, options.resamples)
    os.makedirs(options.out, exist_ok=True)
    atomic_write_text(os.path.join(options.out, "diagnose.json"), json.dumps(records, indent=1))
    text = table(records)
    atomic_write_text(os.path.join(options.out, "diagnose.md"), text + "\n")
    print(text)
    print(f"wrote {options.out}/diagnose.json and diagnose.md (docs/diagnose.md: what each outcome means)")
    return records
