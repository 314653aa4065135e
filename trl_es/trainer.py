"""ESTrainer: Evolution Strategies post-training with GRPOTrainer's contracts (orchestration only).

The step loop is `_es_step`: capture θ, evaluate each member θ + σ·ε_i (perturb → generate → reward), shape the
population rewards, write the update. The algorithm lives in `trl_es.es`, generation in `trl_es.rollout`,
the reward contract in `trl_es.rewards`. transformers' Trainer supplies data, logging, callbacks, checkpoints and
the Hub; its optimizer is a placeholder that only carries the learning-rate schedule (α_t).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections import defaultdict

import torch
from accelerate.data_loader import BatchSamplerShard
from datasets import Dataset, IterableDataset
from torch.utils.data import DataLoader
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.trainer_utils import _is_peft_model
from transformers.utils import logging
from trl.models.utils import prepare_deepspeed, unwrap_model_for_generation
from trl.trainer.base_trainer import _BaseTrainer
from trl.trainer.utils import (
    disable_dropout_in_model,
    get_config_model_id,
    identity,
    print_prompt_completions_sample,
)

from . import sparse
from .checkpoints import eos_token_ids, load_starting_model, load_tokenizer
from .config import ESConfig
from .es import (
    NoiseTable,
    ParameterSnapshot,
    apply_update,
    member_groups,
    member_seed,
    partition_parameters,
    select_parameters,
    shape_fitness,
)
from .es.lowrank import LowRankPopulation, lowrank_targets, lowrank_update
from .es.noise import _hash64
from .es.update import update_coefficients
from .evaluation import score_problems
from .population import (
    all_reduce_summaries,
    local_slots,
    population_diversity,
    population_metrics,
    summarize,
    summary_width,
)
from .rewards import RewardFunctions
from .rollout import TransformersRollout, VLLMRollout, require_vllm
from .tasks import get_task
from .tasks.data import completion_text


logger = logging.get_logger(__name__)

DISTANCE_SAMPLE = 1 << 20
"""Elements of θ₀ kept to estimate ‖θ − θ₀‖/‖θ₀‖ (every k-th element; exact for smaller models)."""


class ESTrainer(_BaseTrainer):
    """Evolution Strategies trainer taking GRPOTrainer's arguments (model, reward_funcs, datasets, processing
    classes, callbacks) with the same meaning. See `ESConfig` for the algorithm's knobs."""

    _tag_names = ["trl", "trl-es", "evolution-strategies"]
    _name = "ES"
    _paper = {
        "title": "Evolution Strategies at Scale: LLM Fine-Tuning Beyond Reinforcement Learning",
        "id": "2509.24372",
        "citation": (
            "@article{qiu2025evolution,\n    title  = {{Evolution Strategies at Scale: LLM Fine-Tuning Beyond "
            "Reinforcement Learning}},\n    author = {Xin Qiu and others},\n    year   = 2025,\n"
            "    eprint = {arXiv:2509.24372}\n}"
        ),
    }

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs,
        args: ESConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset=None,
        processing_class: PreTrainedTokenizerBase | None = None,
        reward_processing_classes=None,
        callbacks=None,
        peft_config=None,
    ):
        if args is None:
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = ESConfig(f"{str(name).rstrip('/').split('/')[-1]}-ES")
        if not isinstance(args, ESConfig):
            raise TypeError(f"`args` must be an ESConfig, got {type(args).__name__}")
        self._check_dataset(train_dataset)
        if eval_dataset is not None:
            self._check_dataset(eval_dataset, "eval_dataset")
            missing = sorted(
                set(getattr(train_dataset, "column_names", None) or [])
                - set(getattr(eval_dataset, "column_names", None) or train_dataset.column_names)
            )
            if missing:
                raise ValueError(
                    f"`eval_dataset` lacks column(s) {missing} that `train_dataset` has: the reward functions read "
                    "the same columns in both"
                )

        model_path = model if isinstance(model, str) else None
        if isinstance(model, str):
            model_init_kwargs = dict(args.model_init_kwargs or {})
            model = load_starting_model(model, args.es_adapter_only, **model_init_kwargs)
        elif args.model_init_kwargs is not None:
            logger.warning("`model_init_kwargs` is ignored: the model is already instantiated.")
        if not isinstance(model, PreTrainedModel) and not _is_peft_model(model):
            raise TypeError(
                f"`model` must be a model id, a path, a PreTrainedModel or a PeftModel, got {type(model).__name__}"
            )
        if peft_config is not None:  # as in GRPOTrainer: a new adapter; ES then perturbs its weights only
            if _is_peft_model(model):
                raise ValueError(
                    "`peft_config` adds a new adapter, but the model already is a PeftModel (an adapter "
                    "loaded with es_adapter_only): pass one or the other"
                )
            try:
                from peft import get_peft_model
            except ImportError as error:
                raise ImportError("`peft_config` needs peft: pip install 'trl-es[peft]'") from error
            model = get_peft_model(model, peft_config)
        if args.use_vllm:
            require_vllm()
            if _is_peft_model(model):
                raise ValueError(
                    "use_vllm=True loads full models into vLLM, which ES perturbs by HF parameter name: "
                    "train adapters (peft_config, es_adapter_only) with use_vllm=False"
                )
        if _is_peft_model(model) and args.sparse_delta_tau is not None:
            raise ValueError(
                "ESConfig.sparse_delta_tau needs a full model: a PEFT adapter is already a compact update (train "
                "without es_adapter_only to get a sparse delta of the merged model)"
            )

        if processing_class is None:
            processing_class = load_tokenizer(model_path, model)
        if not isinstance(processing_class, PreTrainedTokenizerBase):
            raise TypeError("`processing_class` must be a tokenizer (PreTrainedTokenizerBase); ESTrainer is text-only")
        if len(processing_class) > model.get_input_embeddings().num_embeddings:
            raise ValueError(
                f"the tokenizer has {len(processing_class)} tokens but the model's embedding only "
                f"{model.get_input_embeddings().num_embeddings} rows: they do not belong together"
            )
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        model.config.get_text_config().pad_token_id = processing_class.pad_token_id
        model.generation_config.pad_token_id = processing_class.pad_token_id
        eos_ids = eos_token_ids(model, processing_class)
        disable_dropout_in_model(model)

        self.reward_functions = RewardFunctions(
            reward_funcs,
            reward_weights=args.reward_weights,
            reward_processing_classes=reward_processing_classes,
            model_init_kwargs=args.model_init_kwargs,
            chat_template_kwargs=args.chat_template_kwargs,
        )

        super().__init__(
            model=model,
            args=args,
            data_collator=identity,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
        )
        n_slots = args.population_size + (args.es_baseline == "center")
        if self.accelerator.num_processes > n_slots:
            logger.warning(
                f"{self.accelerator.num_processes} processes for {n_slots} evaluations per step (population and "
                f"centre): {self.accelerator.num_processes - n_slots} processes will only wait. Use at most "
                f"{n_slots} processes or a larger population_size."
            )
        # Under DeepSpeed, ESTrainer prepares the model itself (`_prepare_for_training`): Trainer's DeepSpeed paths
        # build a training engine, save engine checkpoints and gather through it, none of which applies to ES.
        self._zero_stage = self.accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else None
        self.is_deepspeed_enabled = False
        self.model.add_model_tags(self._tag_names)
        self.reward_functions.to(self.accelerator.device)

        generation_kwargs = {
            "max_new_tokens": args.max_completion_length,
            "do_sample": True,
            "pad_token_id": processing_class.pad_token_id,
            "bos_token_id": processing_class.bos_token_id,
            "eos_token_id": eos_ids,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty,
            **(args.generation_kwargs or {}),
        }
        rollout_args = (
            self.model,
            processing_class,
            GenerationConfig(**generation_kwargs, disable_compile=True),
            eos_ids,
            args.chat_template_kwargs,
        )
        if args.use_vllm:
            if self._zero_stage == 3:
                raise ValueError(
                    "use_vllm=True needs θ whole on every process: use ZeRO-2 or none (ZeRO-3 partitions it)"
                )
            if args.vllm_mode == "server" and self.accelerator.num_processes > 1:
                raise ValueError(
                    f"vllm_mode='server' with {self.accelerator.num_processes} processes: a server holds one member's "
                    "weights at a time, so one training process drives it. Use one process, or vllm_mode='colocate'."
                )
            self.rollout = VLLMRollout(*rollout_args, args, self.accelerator)
        else:
            self.rollout = TransformersRollout(*rollout_args)
        self._vllm_started = False
        self._resumed_from = None  # the checkpoint the weights came from, for a vLLM server to load them too
        self.es_params = select_parameters(self.model.named_parameters(), args.es_parameter_patterns)
        self._groups = self._member_groups = None
        self._lowrank_targets = None
        self._merge = self._candidates = None
        if args.es_search_space == "merge":
            self._merge = self._prepare_merge_search()
        if args.es_search_space == "lowrank":
            self._lowrank_targets = lowrank_targets(self.model, self.es_params)
            if not self._lowrank_targets:
                raise ValueError(
                    "es_search_space='lowrank' perturbs nn.Linear weights, and none is among the "
                    "parameters ES selects (es_parameter_patterns)"
                )
        if args.es_search_space == "copes":
            self._groups = partition_parameters(
                list(self.es_params), args.copes_groups, args.copes_partition, args.seed
            )
            self._member_groups = member_groups(args.population_size, args.copes_groups, args.antithetic)
        self._snapshot = None  # allocated at the first step, freed after training
        self._noise_table = None
        self._start_sample = None
        self._metrics = defaultdict(list)
        self._last_completions = None
        self._completions_step = None

    @staticmethod
    def _check_dataset(dataset, name: str = "train_dataset"):
        if dataset is None:
            raise ValueError(f"ESTrainer needs a `{name}` with a 'prompt' column")
        columns = getattr(dataset, "column_names", None)
        if columns is not None and "prompt" not in columns:
            raise ValueError(f"`{name}` has no 'prompt' column (columns: {columns})")
        if isinstance(dataset, Dataset):
            if len(dataset) == 0:
                raise ValueError(f"`{name}` is empty")
            prompt = dataset[0]["prompt"]
            is_messages = isinstance(prompt, list) and all(
                isinstance(m, dict) and {"role", "content"} <= m.keys() for m in prompt
            )
            if not (isinstance(prompt, str) or (is_messages and prompt)):
                raise ValueError(
                    "each 'prompt' must be text or a list of {'role', 'content'} messages; row 0 holds "
                    f"{type(prompt).__name__}: {prompt!r:.80}"
                )

    # ---- Trainer plumbing -------------------------------------------------------------------------------------

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    def create_optimizer(self, model=None):
        """A placeholder: ES keeps no optimizer state. This SGD over one scalar that never receives a gradient
        (so `step()` does nothing) lets Trainer's scheduler drive α_t, saved and resumed with checkpoints."""
        if self.optimizer is None:
            self._lr_holder = torch.nn.Parameter(torch.zeros((), device=self.args.device))
            self.optimizer = torch.optim.SGD([self._lr_holder], lr=self.args.learning_rate)
        return self.optimizer

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """Trainer's hook (transformers 5.16–5.19) that wraps the model and builds the optimizer and scheduler.

        ES never back-propagates, so the model is wrapped neither in DistributedDataParallel (whose gradient buckets
        would cost a second copy of θ) nor in a DeepSpeed training engine (whose optimizer would hold state). Under
        ZeRO-3 an inference engine (TRL's `prepare_deepspeed`, as for GRPO's reference model) partitions θ across
        processes; ZeRO-1/2 partition optimizer state and gradients, which ES does not have, so they run unwrapped.
        """
        if self._created_lr_scheduler:
            self.lr_scheduler, self._created_lr_scheduler = None, False
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps, optimizer=self.optimizer)
        if self._zero_stage == 3:
            if self.model_wrapped is self.model:
                self.model_wrapped = prepare_deepspeed(self.model, self.accelerator)
        else:
            self.model.to(self.args.device)
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        return self.model_wrapped, train_dataloader

    def _full_parameters(self):
        """Context in which every process holds all of θ. Under ZeRO-3 θ is gathered: through the engine with TRL's
        `unwrap_model_for_generation` (which also lifts ZeRO-3's forward hooks), or, before the engine exists, with
        DeepSpeed's `GatheredParameters` (parameters partitioned at load by `zero.Init`). Otherwise nothing to do."""
        if self._zero_stage != 3:
            return contextlib.nullcontext()
        if self.model_wrapped is not self.model:
            return unwrap_model_for_generation(self.model_wrapped, self.accelerator)
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.model.parameters()))

    @torch.no_grad()
    def _write_shards(self, params):
        """ZeRO-3: copy this process's slice of each (gathered, changed) parameter into its partition, which is what
        remains when θ is released. DeepSpeed partitions the flattened parameter evenly by rank."""
        rank = self.accelerator.process_index
        for p in params:
            if not hasattr(p, "ds_tensor"):
                continue
            size = p.ds_tensor.numel()
            start, end = rank * size, min((rank + 1) * size, p.ds_numel)
            if end > start:
                p.ds_tensor.data[: end - start].copy_(p.data.view(-1)[start:end])

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Trainer's checkpoint loading; under ZeRO-3 every process loads into the gathered θ and keeps its slice."""
        with self._full_parameters():
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            self._write_shards(self.model.parameters())
        self._resumed_from, self._vllm_started = resume_from_checkpoint, False  # vLLM takes the loaded θ
        search_state = os.path.join(resume_from_checkpoint, "merge_search.pt")
        if self._merge is not None:
            if not os.path.isfile(search_state):
                raise FileNotFoundError(f"{search_state} is missing: this checkpoint was not saved by a Hyper-ES run")
            self._merge["search"].load_state_dict(torch.load(search_state))

    def floating_point_ops(self, inputs) -> int:
        return 0  # no forward/backward FLOPs in Trainer's sense

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        learning_rate = (
            self.lr_scheduler.get_last_lr()[0] if self.lr_scheduler is not None else self.args.learning_rate
        )
        self._es_step(inputs, self.state.global_step, learning_rate)
        return torch.zeros((), device=self.args.device)

    def get_train_dataloader(self):
        """Every process reads the same prompts: the population is split across processes, not the data. So the
        step's prompts are `per_device_train_batch_size` rows whatever the number of processes."""
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            # Iterated identically on every process (no Accelerate sharding or dispatching).
            return DataLoader(
                self.train_dataset,
                batch_size=self._train_batch_size,
                collate_fn=self.data_collator,
                num_workers=self.args.dataloader_num_workers,
            )
        dataloader = super().get_train_dataloader()
        if isinstance(dataloader.batch_sampler, BatchSamplerShard):  # undo Accelerate's per-process sharding
            dataloader.batch_sampler.num_processes, dataloader.batch_sampler.process_index = 1, 0
        return dataloader

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            self._snapshot = self._noise_table = None  # free the copy of θ and the table (rebuilt from the seed)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs = {k: v for k, v in logs.items() if k not in ("loss", "grad_norm")}
        if self._metrics and "train_runtime" not in logs:
            logs.update({key: sum(values) / len(values) for key, values in self._metrics.items()})
            self._metrics.clear()
            if self.args.log_completions and self._last_completions and self.accelerator.is_main_process:
                prompts, completions, rewards, extras = self._last_completions
                print_prompt_completions_sample(
                    prompts,
                    completions,
                    rewards,
                    None,
                    self.state.global_step,
                    self.args.num_completions_to_print,
                    extras or None,
                )
        super().log(logs, start_time)

    # ---- The ES step ------------------------------------------------------------------------------------------

    def _member_directions(self, step: int) -> list[tuple[int, int]]:
        """(noise seed, sign) of each member: ε_i from seed(t, i), or ±ε_k from seed(t, k) for antithetic pairs."""
        n, seed = self.args.population_size, self.args.seed
        if self.args.antithetic:
            return [(member_seed(seed, step, i // 2), 1 if i % 2 == 0 else -1) for i in range(n)]
        return [(member_seed(seed, step, i), 1) for i in range(n)]

    def _sampling_seed(self, step: int, member: int | str) -> int:
        key = "common" if self.args.common_generation_seed else member
        return _hash64("es-sampling", self.args.seed, step, key)

    def _start_vllm(self):
        """Give vLLM the trainer's θ and noise table (once, at the first step or evaluation)."""
        if self.args.use_vllm and not self._vllm_started:
            self.rollout.start(list(self.es_params), self.args.seed, self.args.noise_table_size, self._resumed_from)
            self._vllm_started = True

    def _prepare_es_state(self):
        self._start_vllm()
        device = next(iter(self.es_params.values())).device
        if self._noise_table is None:
            self._noise_table = NoiseTable(self.args.seed, self.args.noise_table_size, device)
        if self._snapshot is None:
            self._snapshot = ParameterSnapshot(self.es_params, storage_device="cpu")
        if self._start_sample is None:
            total = sum(p.numel() for p in self.es_params.values())
            self._stride = max(1, total // DISTANCE_SAMPLE)
            self._start_sample = [
                p.detach().view(-1)[:: self._stride].to("cpu", torch.float32, copy=True)
                for p in self.es_params.values()
            ]

    def _generate_and_score(self, rows, prompt_ids, sampling_seed, extras):
        """Generate with the current weights and score (`_score`)."""
        timer = time.perf_counter()
        rollout = self.rollout.generate(
            [row["prompt"] for row in rows],
            prompt_ids,
            self.args.num_generations,
            sampling_seed,
            self.args.log_completion_entropy,
        )
        self._metrics["es/time/generate"].append(time.perf_counter() - timer)
        return (*self._score(rows, rollout, extras), rollout)

    def _score(self, rows, rollout, extras):
        """(member reward R = mean completion reward, per-function rewards of each completion) of one member's
        rollout. Columns that reward functions log with `log_extra` go to `extras`."""
        timer = time.perf_counter()
        per_func = self.reward_functions(
            [row for row in rows for _ in range(self.args.num_generations)],
            rollout.prompts,
            rollout.completions,
            rollout.completion_ids,
            trainer_state=self.state,
            log_metric=lambda name, value: self._metrics[name].append(value),
            log_extra=lambda column, values: extras[column].extend(values),
        )
        reward = self.reward_functions.combine(per_func).nanmean().item()
        self._metrics["es/time/reward"].append(time.perf_counter() - timer)
        return reward, per_func

    def _record(self, s, slot, step, rows, reward, per_func, rollout, extras, summaries) -> None:
        """Write slot `s`'s summary row; keep the completions table of this process's first member."""
        combined = self.reward_functions.combine(per_func)
        success = (combined >= self.args.success_threshold).double().view(len(rows), -1).mean(1)  # NaN: no success
        entropy_sum = sum(rollout.entropy_sums) if rollout.entropy_sums else 0.0
        summaries[s] = summarize(
            reward,
            torch.cat([combined[:, None], per_func], dim=1),
            [len(ids) for ids in rollout.completion_ids],
            rollout.truncated,
            entropy_sum,
            success,
        )
        if slot != "center" and self._completions_step != step:
            names = self.reward_functions.names
            table_rewards = {n: per_func[:, k].tolist() for k, n in enumerate(names)}
            self._last_completions = (rollout.prompts, rollout.completions, table_rewards, dict(extras))
            self._completions_step = step

    def _es_step(self, rows: list[dict], step: int, learning_rate: float) -> None:
        """One ES step with all of θ in hand (gathered under ZeRO-3, whose partitions then take the update)."""
        with self._full_parameters():
            self._es_step_full(rows, step, learning_rate)
            self._write_shards(self.es_params.values())

    def _evaluate_slots(self, rows, prompt_ids, step, slots, directions, summaries) -> float:
        """Evaluate this process's share of the step's slots (`local_slots`), each written as θ + σ·ε from the
        snapshot, and fill their rows of `summaries`. Returns the seconds spent perturbing."""
        args, accelerator, noise_time = self.args, self.accelerator, 0.0
        for s in local_slots(len(slots), accelerator.process_index, accelerator.num_processes):
            slot = slots[s]  # the centre, if any, is slot 0 and is evaluated before any perturbation
            perturbed, scale = None, args.sigma  # full ES: every parameter
            if self._groups is not None and slot != "center":  # CoPES: the member's group, σ·√K
                perturbed, scale = self._groups[self._member_groups[slot]], args.sigma * len(self._groups) ** 0.5
            timer = time.perf_counter()
            if args.use_vllm:  # vLLM rebuilds the member from its seed; the centre is θ
                if slot == "center":
                    self.rollout.restore()
                else:
                    seed, sign = directions[slot]
                    self.rollout.perturb(seed, sign * scale, perturbed)
            elif slot != "center":
                if self._merge is not None:  # Hyper-ES: the member is a candidate merge
                    self._write_weights(self._merged(self._candidates[slot]))
                else:
                    seed, sign = directions[slot]
                    self._snapshot.perturb(self._noise_table, seed, sign * scale, perturbed)
            noise_time += time.perf_counter() - timer
            extras = defaultdict(list)
            sampling_seed = self._sampling_seed(step, slot)
            reward, per_func, rollout = self._generate_and_score(rows, prompt_ids, sampling_seed, extras)
            self._record(s, slot, step, rows, reward, per_func, rollout, extras, summaries)
            if perturbed is not None and not args.use_vllm:  # the next member may perturb another group: back to θ
                self._snapshot.restore(perturbed)
        return noise_time

    def _evaluate_slots_batched(self, rows, prompt_ids, step, slots, directions, summaries) -> float:
        """EGGROLL: this process's slots in batched `generate` calls (`lowrank_members_per_call` members each), row
        by row seeing its member's low-rank perturbation θ + σ·A·Bᵀ/√r (the centre none), applied in the forward
        pass: the weights are never written. Returns the seconds spent building the perturbations."""
        args, accelerator = self.args, self.accelerator
        mine = local_slots(len(slots), accelerator.process_index, accelerator.num_processes)
        per_call = args.lowrank_members_per_call or len(mine) or 1
        prompts, width, noise_time = [row["prompt"] for row in rows], len(rows) * args.num_generations, 0.0
        for start in range(0, len(mine), per_call):
            part = mine[start : start + per_call]
            members = [slots[s] for s in part if slots[s] != "center"]
            row_members = torch.tensor([-1 if slots[s] == "center" else members.index(slots[s]) for s in part])
            timer = time.perf_counter()
            population = LowRankPopulation(
                self._lowrank_targets,
                [directions[m][0] for m in members],
                [directions[m][1] for m in members],
                args.sigma,
                args.lowrank_rank,
                row_members.repeat_interleave(width),
            )
            with population:
                noise_time += time.perf_counter() - timer
                timer = time.perf_counter()
                rollout = self.rollout.generate(
                    prompts * len(part),
                    prompt_ids * len(part),
                    args.num_generations,
                    self._sampling_seed(step, f"call-{start}"),
                    args.log_completion_entropy,
                )
            for _ in part:  # es/time/generate is per member
                self._metrics["es/time/generate"].append((time.perf_counter() - timer) / len(part))
            for j, s in enumerate(part):
                extras = defaultdict(list)
                member_rollout = rollout.select(j * width, (j + 1) * width)
                reward, per_func = self._score(rows, member_rollout, extras)
                self._record(s, slots[s], step, rows, reward, per_func, member_rollout, extras, summaries)
        return noise_time

    def _es_step_full(self, rows: list[dict], step: int, learning_rate: float) -> None:
        """One ES step (DESIGN §2), this process evaluating its share of the population (`trl_es.population`).

        On any exception, KeyboardInterrupt included, θ is restored bitwise. A failure on one process is reported to
        all at the all-reduce, so every process restores θ and raises instead of waiting for the others.
        """
        args, accelerator = self.args, self.accelerator
        self._prepare_es_state()
        snapshot = self._snapshot
        prompt_ids = self.rollout.tokenize([row["prompt"] for row in rows])
        directions = self._member_directions(step)
        if self._merge is not None:
            self._candidates = self._merge["search"].ask()  # the same on every process: CMA-ES is seeded
        slots = (["center"] if args.es_baseline == "center" else []) + list(range(len(directions)))
        width = summary_width(len(self.reward_functions.names), len(rows))
        summaries = torch.zeros(len(slots), width, dtype=torch.float64)
        timer = time.perf_counter()
        snapshot.capture()
        noise_time = time.perf_counter() - timer  # the copy of θ counts with the perturbations
        try:
            error = None
            try:
                evaluate = self._evaluate_slots_batched if self._lowrank_targets else self._evaluate_slots
                noise_time += evaluate(rows, prompt_ids, step, slots, directions, summaries)
            except Exception as exc:  # reported to the other processes below, then raised
                error = exc
            timer = time.perf_counter()
            try:
                summaries, failed = all_reduce_summaries(
                    summaries, error is not None, accelerator.device, args.ddp_timeout
                )
            except RuntimeError as exc:  # torch.distributed timeouts and lost peers are RuntimeErrors
                raise RuntimeError(
                    f"ES step {step}: process {accelerator.process_index} of {accelerator.num_processes} gave up "
                    f"waiting for the other processes' rewards (ddp_timeout={args.ddp_timeout} s): another process "
                    "hung, died or was killed. This process's weights are restored to the start of the step; "
                    "resume from the last checkpoint."
                ) from exc
            communication_time = time.perf_counter() - timer
            if error is not None:
                raise error
            if failed:
                raise RuntimeError(
                    f"ES step {step}: process(es) {failed} failed while evaluating their members (their traceback "
                    "says why); the weights are restored on every process."
                )
            timer = time.perf_counter()
            first_member = len(slots) - len(directions)
            member_rewards = summaries[first_member:, 0]
            center = summaries[0, 0].item() if first_member else None
            baseline = center if center is not None and center == center else 0.0  # a NaN centre gives no baseline
            fitness = shape_fitness(member_rewards - baseline, args.fitness_shaping)
            if fitness is None:
                warnings.warn(
                    f"ES step {step}: the population rewards have no spread ({member_rewards.tolist()}); "
                    "the weights are left unchanged. Rewards that are all equal or all None (NaN) carry no signal.",
                    stacklevel=2,
                )
                self._restore()
                update_norm = 0.0
                self._metrics["es/skipped_update"].append(1.0)
            else:
                update_norm = self._apply_update(fitness, member_rewards, directions, learning_rate)
                self._metrics["es/skipped_update"].append(0.0)
            update_time = time.perf_counter() - timer
        except BaseException:
            self._restore()
            raise
        metrics = self._metrics
        if center is not None:
            metrics["es/center_reward"].append(center)
        member_rows = summaries[first_member:]
        for name, value in population_metrics(
            member_rows, self.reward_functions.names, args.log_completion_entropy
        ).items():
            metrics[name].append(value)
        if args.log_population_diversity:
            metrics["es/population_diversity"].append(population_diversity(member_rows, len(rows)))
        valid = member_rewards[~torch.isnan(member_rewards)]
        if valid.numel():
            metrics["es/population_reward_min"].append(valid.min().item())
            metrics["es/population_reward_max"].append(valid.max().item())
            metrics["es/population_reward_std"].append(valid.std(unbiased=False).item())
        metrics["es/sigma"].append(args.sigma)
        metrics["es/update_norm"].append(update_norm)
        metrics["es/rel_distance_from_start"].append(self._distance_from_start())
        metrics["es/time/noise"].append(noise_time)
        metrics["es/time/update"].append(update_time)
        metrics["es/time/communication"].append(communication_time)

    def _restore(self) -> None:
        """θ back in the model (bitwise, from the snapshot) and in vLLM."""
        self._snapshot.restore()
        if self.args.use_vllm:
            self.rollout.restore()

    def _update(self, coefficients: dict[int, float], decay: float, names: list[str] | None = None) -> float:
        """`apply_update` on the model and, with vLLM, the same update inside vLLM (checked by its norm)."""
        norm = apply_update(self._snapshot, self._noise_table, coefficients, decay=decay, names=names)
        if self.args.use_vllm:
            vllm_norm = self.rollout.update(coefficients, decay, names)
            if abs(vllm_norm - norm) > 1e-5 * max(norm, 1e-12):
                raise RuntimeError(
                    f"vLLM's update (‖Δθ‖ = {vllm_norm}) differs from the trainer's ({norm}): its "
                    "weights no longer follow the trainer's"
                )
        return norm

    def _apply_update(self, fitness, member_rewards, directions, learning_rate) -> float:
        """θ ← θ + α·(1/N)·Σ z_i ε_i over the members with a reward; under CoPES per group g, over its members
        (θ_g ← θ_g + α·(1/N_g)·Σ_{i∈g} z_i ε_i,g); low-rank: W ← W + α·(1/N)·Σ z_i A_i B_iᵀ/√r per matrix.
        Returns ‖Δθ‖."""
        decay = learning_rate * self.args.weight_decay
        valid = (~torch.isnan(member_rewards)).tolist()
        if self._merge is not None:
            return self._merge_update(member_rewards)
        if self._lowrank_targets:
            weights = {name: module.weight.data for name, module in self._lowrank_targets.items()}
            return lowrank_update(weights, directions, fitness, learning_rate, sum(valid), self.args.lowrank_rank)
        if self._groups is None:
            coefficients = update_coefficients(fitness, directions, learning_rate, sum(valid))
            return self._update(coefficients, decay)
        squared = 0.0
        for g, names in enumerate(self._groups):
            members = [i for i, group in enumerate(self._member_groups) if group == g]
            n_valid = max(sum(valid[i] for i in members), 1)
            group_directions = [directions[i] for i in members]
            coefficients = update_coefficients(fitness[members], group_directions, learning_rate, n_valid)
            squared += self._update(coefficients, decay, names) ** 2
        return squared**0.5

    # ---- Hyper-ES: CMA-ES over merge coefficients ----------------------------------------------------------------

    def _prepare_merge_search(self) -> dict:
        """Task vectors τ_k = θ_k − θ_base of `merge_models` against the starting weights, their layer groups and
        the CMA-ES search over the (K × L) merge coefficients (`trl_es.es.merge`)."""
        args = self.args
        if self._zero_stage == 3:
            raise ValueError("es_search_space='merge' holds the base and task vectors whole: use ZeRO-2 or none")
        try:
            from .es.merge import MergeSearch, layer_groups, task_vectors
        except ImportError as error:
            raise ImportError("es_search_space='merge' needs cma and peft: pip install 'trl-es[merge]'") from error
        base = {name: p.detach().to("cpu", copy=True) for name, p in self.es_params.items()}
        tuned = []
        for path in args.merge_models:
            named = dict(load_starting_model(path).named_parameters())
            missing = [name for name in base if name not in named]
            if missing:
                raise ValueError(
                    f"merge model {path!r} lacks {missing[:3]}: it is not a fine-tuned version of this model"
                )
            tuned.append({name: named[name].detach() for name in base})
        vectors = task_vectors(base, tuned)
        groups = layer_groups(list(base))
        search = MergeSearch(
            len(vectors),
            max(groups.values()) + 1,
            init=args.merge_init,
            sigma0=args.merge_sigma,
            popsize=args.population_size,
            seed=args.seed,
        )
        return {"base": base, "vectors": vectors, "groups": groups, "search": search}

    def _merged(self, coefficients: torch.Tensor) -> dict[str, torch.Tensor]:
        from .es.merge import merge

        m = self._merge
        return merge(m["base"], m["vectors"], coefficients, m["groups"], self.args.merge_density, self.args.seed)

    @torch.no_grad()
    def _write_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for name, p in self.es_params.items():
            p.copy_(weights[name])

    def _merge_update(self, member_rewards: torch.Tensor) -> float:
        """CMA-ES `tell` with the candidates' rewards (a candidate without a reward counts as the worst one); θ
        becomes the best merge found so far. Returns ‖Δθ‖."""
        rewards = member_rewards.clone()
        rewards[rewards.isnan()] = rewards[~rewards.isnan()].min()
        search = self._merge["search"]
        search.tell(self._candidates, rewards.tolist())
        best, best_reward = search.best()
        self._write_weights(self._merged(best))
        self._metrics["es/merge_best_reward"].append(best_reward)
        return (
            sum(
                float((p.detach().float() - self._snapshot.copies[name].float()).square().sum())
                for name, p in self.es_params.items()
            )
            ** 0.5
        )

    def _save_checkpoint(self, model, trial):
        """Trainer's checkpoint, plus the CMA-ES state under Hyper-ES (`merge_search.pt`)."""
        super()._save_checkpoint(model, trial)
        if self._merge is not None and self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial), f"checkpoint-{self.state.global_step}")
            torch.save(self._merge["search"].state_dict(), os.path.join(folder, "merge_search.pt"))

    # ---- Evaluation ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Pass@K for K in `eval_k` (and Maj@K with `eval_task`) of the current θ on the eval prompts, with
        `num_generations_eval` completions each; a completion is correct when its combined reward is ≥
        `success_threshold`. Also the mean reward and token entropy. Each process takes every K-th prompt; the
        sums are all-reduced. Runs at `eval_steps` with `eval_strategy="steps"`, as in any Trainer."""
        args, accelerator = self.args, self.accelerator
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            raise ValueError("ESTrainer.evaluate needs an `eval_dataset`")
        start_time = time.perf_counter()
        n = args.num_generations_eval or args.num_generations
        extract = get_task(args.eval_task).extract_answer if args.eval_task else None
        keys = [f"pass@{k}" for k in args.eval_k] + ([f"maj@{k}" for k in args.eval_k] if extract else [])
        rank, world = accelerator.process_index, accelerator.num_processes
        rows = list(dataset)[rank::world]
        totals = torch.zeros(len(keys) + 5, dtype=torch.float64)  # keys, problems, Σreward, rewards, tokens, Σentropy
        entropy = not args.use_vllm  # vLLM does not return the full next-token distribution
        self._start_vllm()
        with self._full_parameters():
            for start in range(0, len(rows), args.per_device_eval_batch_size):
                chunk = rows[start : start + args.per_device_eval_batch_size]
                prompts = [row["prompt"] for row in chunk]
                # seeded by the chunk's first problem: with one prompt per chunk, K processes sample as one does
                seed = _hash64("es-eval", args.seed, self.state.global_step, rank + start * world)
                rollout = self.rollout.generate(prompts, self.rollout.tokenize(prompts), n, seed, entropy)
                per_func = self.reward_functions(
                    [row for row in chunk for _ in range(n)],
                    rollout.prompts,
                    rollout.completions,
                    rollout.completion_ids,
                    trainer_state=self.state,
                    log_metric=lambda *_: None,
                    log_extra=lambda *_: None,
                )
                combined = self.reward_functions.combine(per_func)
                answers = [extract(completion_text(c)) for c in rollout.completions] if extract else None
                sums = score_problems(chunk, (combined >= args.success_threshold).tolist(), answers, n, args.eval_k)
                totals += torch.tensor(
                    [
                        *(sums[key] for key in keys),
                        len(chunk),
                        combined.nansum(),
                        (~combined.isnan()).sum(),
                        sum(map(len, rollout.completion_ids)),
                        sum(rollout.entropy_sums or [0.0]),
                    ],
                    dtype=torch.float64,
                )
        totals = accelerator.reduce(totals.to(accelerator.device), "sum").cpu().tolist()
        problems, reward_sum, rewards, tokens, entropy_sum = totals[len(keys) :]
        metrics = {f"{metric_key_prefix}_{key}": total / problems for key, total in zip(keys, totals, strict=False)}
        metrics[f"{metric_key_prefix}_reward"] = reward_sum / rewards if rewards else float("nan")
        if entropy:
            metrics[f"{metric_key_prefix}_mean_token_entropy"] = entropy_sum / max(tokens, 1)
        metrics[f"{metric_key_prefix}_runtime"] = round(time.perf_counter() - start_time, 4)
        super().log(metrics)  # not self.log, which would fold pending training metrics into this record
        self.control = self.callback_handler.on_evaluate(args, self.state, self.control, metrics)
        return metrics

    def _distance_from_start(self) -> float:
        """‖θ − θ₀‖/‖θ₀‖ over every k-th element of θ (k = `self._stride`)."""
        diff = norm = 0.0
        for p, start in zip(self.es_params.values(), self._start_sample, strict=True):
            now = p.detach().view(-1)[:: self._stride].float().cpu()
            diff += float((now - start).square().sum())
            norm += float(start.square().sum())
        return (diff / norm) ** 0.5 if norm else 0.0

    # ---- Saving -----------------------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the model with HF names (the main process writes; under ZeRO-3 every process takes part in
        gathering θ, so call it on every process, as Trainer does)."""
        output_dir = output_dir or self.args.output_dir
        with self._full_parameters():
            super().save_model(output_dir, _internal_call)
            if self.args.sparse_delta_tau is not None and not _internal_call and self.args.should_save:
                self._save_sparse_delta(output_dir)
        if not _internal_call and os.path.abspath(output_dir) == os.path.abspath(self.args.output_dir):
            self.create_model_card()

    def _save_sparse_delta(self, output_dir: str) -> None:
        """Write `sparse_delta.safetensors` (|θ − θ_start| > τ, θ_start reloaded from the model's path) and keep
        its statistics for the model card."""
        tau, base_path = self.args.sparse_delta_tau, get_config_model_id(self.model.config)
        try:
            base_model = type(self.model).from_pretrained(base_path, dtype=self.model.dtype)
        except OSError as error:
            logger.warning(f"No sparse delta written: cannot load the starting weights at {base_path!r} ({error}).")
            return
        base, tuned = dict(base_model.named_parameters()), dict(self.model.named_parameters())
        path = os.path.join(output_dir, "sparse_delta.safetensors")
        masks = sparse.threshold_masks(base, tuned, tau=tau)
        metadata = sparse.save_delta(path, base, tuned, masks, base_model=base_path, tau=tau)
        total = sparse.update_statistics(base, tuned, [tau])["total"]
        self._sparse_delta_card = {
            "sparse delta": f"sparse_delta.safetensors, τ = {tau}",
            "entries kept": f"{int(metadata['kept'])} (sparsity {float(metadata['sparsity']):.4%})",
            "delta file size": f"{os.path.getsize(path) / 2**20:.2f} MiB",
            "relative L2 ‖Δ‖/‖θ_start‖": f"{total['relative_l2']:.4g}",
            "nonzero updates": f"{total['nonzero_share']:.2%}",
            f"s_τ (share of nonzero |Δ| ≤ {tau})": f"{total['s_tau'][tau]:.2%}",
        }

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's model card (tags trl, trl-es, evolution-strategies) plus the base model and ES settings."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        args = self.args
        settings = {
            "base model": get_config_model_id(self.model.config),
            "population_size": args.population_size,
            "sigma": args.sigma,
            "learning_rate (α)": args.learning_rate,
            "antithetic": args.antithetic,
            "fitness_shaping": args.fitness_shaping,
            "es_baseline": args.es_baseline,
            "common_generation_seed": args.common_generation_seed,
            "es_parameter_patterns": args.es_parameter_patterns,
            "weight_decay": args.weight_decay,
            "num_generations": args.num_generations,
            "prompts per step": args.per_device_train_batch_size,
            "steps": self.state.global_step,
            "seed": args.seed,
            "reward functions": ", ".join(self.reward_functions.names),
        }
        settings.update(getattr(self, "_sparse_delta_card", {}))
        rows = "\n".join(f"| {k} | `{v}` |" for k, v in settings.items())
        path = os.path.join(args.output_dir, "README.md")
        with open(path, "a", encoding="utf-8") as card:
            card.write(f"\n## Evolution Strategies settings\n\n| setting | value |\n|---|---|\n{rows}\n")
