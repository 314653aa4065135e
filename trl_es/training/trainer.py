"""ESTrainer: Evolution Strategies post-training with GRPOTrainer's contracts.

One ES step (`_es_step`) reads top to bottom: the search space asks for the step's members; this process evaluates
its share of them (form the member, generate, score); one all-reduce gathers every member's rewards; they are shaped
into fitness; the search space is told, which is the update; the step's metrics are logged. What a member is lives in
the search space (`trl_es.es.space`), where its weights are written in the weights backend (`trl_es.es.weights`,
vLLM's in `trl_es.generation`), how processes share the work in `trl_es.training.distributed`, logs and evaluation in
`trl_es.training.reporting`, checkpoints and saving in `trl_es.training.checkpoints`. transformers' Trainer supplies data, logging, callbacks, checkpoints and the Hub; its optimizer is a
placeholder that only carries α_t.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable

import torch
from accelerate.data_loader import BatchSamplerShard
from datasets import Dataset, IterableDataset
from torch.utils.data import DataLoader, SequentialSampler
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from trl.trainer.grpo_config import GRPOConfig
from trl.trainer.utils import get_config_model_id, identity

from ..chains import new_chain
from ..es import SearchSpace, search_space, select_parameters, shape_fitness
from ..es.seeds import completion_seeds, sampling_seed
from ..es.space import step_optimizer
from ..generation import make_backend
from ..rewards import RewardFunctions
from ..rollout.episodes import Agents
from ..util.compat import BaseTrainer, check_trainer_hooks
from ..util.models import load_starting_model
from .checkpoints import SavingMixin
from .config import ESConfig
from .distributed import Processes
from .loading import agent_dataset, check_eval_dataset, check_model_type, prepare_model
from .population import DistanceFromStart, SummaryLayout, member_rewards, population_metrics, summarize
from .reporting import ReportingMixin


check_trainer_hooks()


class ESTrainer(ReportingMixin, SavingMixin, BaseTrainer):
    """Evolution Strategies trainer with GRPOTrainer's arguments and their meaning.

    Each step evaluates `population_size` perturbed copies of the model on the step's prompts, scores their
    completions with the reward functions, and moves the weights toward the better members. No backward pass, no
    optimizer state, no reference model.

    Args:
        model (`str` or `PreTrainedModel`): a model id or path (loaded with `args.model_init_kwargs`), a Trainer
            checkpoint or PEFT adapter directory, a `PreTrainedModel` or a `PeftModel`.
        reward_funcs: one reward function or a list, as in GRPOTrainer: callables `f(prompts, completions,
            completion_ids, **columns) -> list[float | None]` (sync or async), sequence-classification reward
            models, or their ids.
        args (`ESConfig`, *optional*): the configuration; defaults to `ESConfig("<model name>-ES")`.
        train_dataset (`Dataset` or `IterableDataset`): a "prompt" column (text or chat messages) and any columns
            the reward functions read.
        eval_dataset (`Dataset`, *optional*): prompts for `evaluate` (Pass@K, Maj@K, reward).
        processing_class (`PreTrainedTokenizerBase`, *optional*): the tokenizer; default: the model's.
        reward_processing_classes (*optional*): tokenizers of reward models, as in GRPOTrainer.
        callbacks (*optional*): Trainer callbacks.
        peft_config (`peft.PeftConfig`, *optional*): a new adapter; ES then perturbs its weights only.

    Example:

    ```python
    from datasets import Dataset
    from trl_es import ESConfig, ESTrainer

    def reward_correct(completions, answer, **kwargs):
        return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]

    dataset = Dataset.from_dict({"prompt": ["What is 2 + 3?"] * 8, "answer": ["5"] * 8})
    trainer = ESTrainer(
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        reward_funcs=reward_correct,
        args=ESConfig(output_dir="es-out", population_size=8, sigma=3e-3, learning_rate=2e-3, max_steps=10),
        train_dataset=dataset,
    )
    trainer.train()
    ```
    """

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
        reward_funcs=None,
        args: ESConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset=None,
        processing_class: PreTrainedTokenizerBase | None = None,
        reward_processing_classes=None,
        callbacks=None,
        peft_config=None,
        tools: list[Callable] | None = None,
        rollout_func: Callable | None = None,
        environment_factory=None,
    ):
        check_model_type(model)
        if args is None:
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = ESConfig(f"{str(name).rstrip('/').split('/')[-1]}-ES")
        if isinstance(args, GRPOConfig):
            raise TypeError(
                "`args` is a GRPOConfig: ESTrainer takes an ESConfig. Convert it with "
                "ESConfig.from_grpo_config(args, population_size=..., sigma=..., learning_rate=...), which keeps its "
                "fields (docs/migrating_from_grpo.md)"
            )
        if not isinstance(args, ESConfig):
            raise TypeError(f"`args` must be an ESConfig, got {type(args).__name__}")
        train_dataset = agent_dataset(train_dataset, args, environment_factory)
        if isinstance(train_dataset, IterableDataset) and args.dataloader_num_workers:
            warnings.warn(  # as GRPOTrainer: each worker would read the whole stream, every prompt N times
                f"dataloader_num_workers={args.dataloader_num_workers} is set to 0 for an iterable train dataset",
                stacklevel=2,
            )
            args.dataloader_num_workers = 0
        if eval_dataset is not None:
            check_eval_dataset(eval_dataset, train_dataset)
        self._model_source = model if isinstance(model, str) else get_config_model_id(model.config)
        self._new_adapter, self.chain = peft_config is not None, None  # the run's seed chain (trl_es.chains)
        model, processing_class, eos_ids = prepare_model(model, args, processing_class, peft_config)
        self.agents = None
        if tools or environment_factory is not None or rollout_func is not None:
            self.agents = Agents(processing_class, args, tools, environment_factory, rollout_func)
        reward_funcs, reward_weights = self._reward_sources(reward_funcs, args.reward_weights)
        self.reward_functions = RewardFunctions(
            reward_funcs,
            reward_weights=reward_weights,
            reward_processing_classes=reward_processing_classes,
            model_init_kwargs=args.model_init_kwargs,
            trust_remote_code=args.trust_remote_code,
            chat_template_kwargs=args.chat_template_kwargs,
        )
        columns = getattr(train_dataset, "column_names", None)
        agents = self.agents
        self.reward_functions.check_signatures(
            columns, agents is not None and bool(agents.factories), agents is not None and agents.generates_itself
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
        # Under DeepSpeed, ESTrainer prepares the model itself (`_prepare_for_training`): Trainer's DeepSpeed paths
        # build a training engine, save engine checkpoints and gather through it, none of which applies to ES.
        zero_stage = self.accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else None
        self.is_deepspeed_enabled = False
        n_slots = args.population_size + (args.es_baseline == "center")
        self.processes = Processes(self.accelerator, zero_stage, args.ddp_timeout, n_slots)
        self.model.add_model_tags(self._tag_names)
        self.reward_functions.to(self.accelerator.device)
        self.es_params = select_parameters(self.model.named_parameters(), args.es_parameter_patterns)
        self.generation, self.weights = make_backend(
            self.model, processing_class, eos_ids, args, self.accelerator, self.es_params, zero_stage
        )
        self.space = self._make_search_space()
        if self.agents is not None:
            self.agents.max_model_length = self.generation.max_model_length
            self.agents.check_reproducible(next(iter(self.train_dataset)), args.seed)
        self._distance = None  # ‖θ − θ₀‖/‖θ₀‖, θ₀ taken at the first step of `train`
        self._metrics = defaultdict(list)
        self._skipped_steps = 0  # steps whose rewards had no spread, warned about once at the end of `train`
        self._last_completions = self._completions_step = None

    def _reward_sources(self, reward_funcs, reward_weights):
        """The reward functions and their weights, with the environments' own rewards (`get_reward`, weight 1)
        after the user's, as GRPOTrainer adds them."""
        funcs = (
            [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs]
        )
        owned = self.agents.reward_funcs if self.agents is not None else []
        if reward_weights is not None and len(reward_weights) != len(funcs):
            raise ValueError(
                f"Number of reward weights ({len(reward_weights)}) must match number of reward functions ({len(funcs)})"
            )
        weights = None if reward_weights is None else [*reward_weights, *[1.0] * len(owned)]
        return funcs + owned, weights

    def _make_search_space(self) -> SearchSpace:
        """The search space `es_search_space` names (`trl_es.es.space.SEARCH_SPACES`), built from ESConfig."""
        if self.args.es_optimizer and self.processes.zero_stage == 3:
            raise ValueError("es_optimizer with ZeRO-3: the optimizer would step on partitioned θ; use ZeRO-2 or none")
        space = search_space(self.args.es_search_space)
        space.check_setup(self.args, self.processes.zero_stage)
        if not isinstance(self.weights, space.backend):
            raise ValueError(
                f"es_search_space={space.name!r} needs a {space.backend.__name__} weights backend, and this run's is "
                f"a {type(self.weights).__name__}"
            )
        return space.from_config(self.args, self.model, self.weights, load_starting_model)

    # GRPOTrainer's public attributes, with the same meaning
    reward_funcs = property(lambda self: self.reward_functions.funcs, doc="The reward functions and models.")
    reward_func_names = property(lambda self: self.reward_functions.names, doc="Their names, as in the logs.")
    reward_weights = property(
        lambda self: self.reward_functions.reward_weights, doc="Their weights (a float32 tensor)."
    )
    reward_processing_classes = property(
        lambda self: self.reward_functions.processing_classes, doc="The reward models' tokenizers (None: callables)."
    )

    # ---- Trainer plumbing -------------------------------------------------------------------------------------

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    def create_optimizer(self, model=None):
        """With `es_optimizer`, Trainer's optimizer (`optim`, …), which the ES step itself steps on the gradient
        estimate the search space wrote (`step_optimizer`; Trainer's own `optimizer.step()` then finds no gradient
        and does nothing). Otherwise a placeholder: the plain update keeps no optimizer
        state; this SGD over one scalar that never receives a gradient (so `step()` does nothing) lets Trainer's
        scheduler drive α_t, saved and resumed with checkpoints."""
        if self.args.es_optimizer:
            return super().create_optimizer(model)
        if self.optimizer is None:
            self._lr_holder = torch.nn.Parameter(torch.zeros((), device=self.args.device))
            self.optimizer = torch.optim.SGD([self._lr_holder], lr=self.args.learning_rate)
        return self.optimizer

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """Trainer's hook (see `compat.TRAINER_HOOKS`) that wraps the model and builds the optimizer and scheduler; ES
        never back-propagates, so the model is prepared for inference only (`Processes.prepare`)."""
        if getattr(self, "_created_lr_scheduler", False):
            self.lr_scheduler, self._created_lr_scheduler = None, False
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps, optimizer=self.optimizer)
        self.model_wrapped = self.processes.prepare(self.model, self.model_wrapped)
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        return self.model_wrapped, train_dataloader

    def _full_parameters(self):
        """Context in which this process holds all of θ (gathered under ZeRO-3)."""
        return self.processes.full_parameters(self.model, self.model_wrapped)

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
        step's prompts are `per_device_train_batch_size` rows whatever the number of processes. With
        `shuffle_dataset` (as GRPOConfig's) a map-style dataset is read in a seeded random order, an iterable one
        through a seeded shuffle buffer; without it, in dataset order."""
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            dataset = self.train_dataset
            if self.args.shuffle_dataset and hasattr(dataset, "shuffle"):
                dataset = dataset.shuffle(seed=self.args.seed)
            return DataLoader(  # iterated identically on every process (no Accelerate sharding or dispatching)
                dataset,
                batch_size=self._train_batch_size,
                collate_fn=self.data_collator,
                num_workers=self.args.dataloader_num_workers,
            )
        dataloader = super().get_train_dataloader()
        if isinstance(dataloader.batch_sampler, BatchSamplerShard):  # undo Accelerate's per-process sharding
            dataloader.batch_sampler.num_processes, dataloader.batch_sampler.process_index = 1, 0
        return dataloader

    def _get_train_sampler(self, train_dataset=None):
        return (
            super()._get_train_sampler(train_dataset)
            if self.args.shuffle_dataset
            else SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)
        )

    def train(self, *args, **kwargs):
        try:
            self.lock_output_dir()
            self._skipped_steps = 0
            self.accelerator.print(self._step_cost(), file=sys.stderr, flush=True)  # on the main process
            output = super().train(*args, **kwargs)
            if self.state.global_step == 0:
                raise ValueError("no ES step ran: the training dataset gave no prompts (is it empty?)")
            if self._skipped_steps:
                warnings.warn(
                    f"{self._skipped_steps} ES step(s) of this run left the weights unchanged: the population rewards "
                    "had no spread (all equal, or all None), so they carried no signal (es/skipped_update = 1 in "
                    "their log records)",
                    stacklevel=2,
                )
            return output
        finally:
            self.weights.release()  # the copy of θ and the noise table, rebuilt from the seed when needed
            self._distance = None
            self.unlock_output_dir()

    def _step_cost(self) -> str:
        """One line, printed when training starts: what one ES step generates."""
        args = self.args
        members = args.population_size + (args.es_baseline == "center")
        completions = members * args.per_device_train_batch_size * args.num_generations
        return (
            f"trl-es: each ES step generates {completions} completions ({members} members × "
            f"{args.per_device_train_batch_size} prompts × num_generations={args.num_generations}, each up to "
            f"{args.max_completion_length} tokens), over {self.accelerator.num_processes} process(es)"
        )

    # ---- The ES step ------------------------------------------------------------------------------------------

    def _es_step(self, rows: list[dict], step: int, learning_rate: float) -> None:
        """One ES step: ask → evaluate this process's slots → all-reduce → shape fitness → tell → log.

        On any exception, KeyboardInterrupt included, θ is restored bitwise. A failure on one process is reported to
        all at the all-reduce, so every process restores θ and raises instead of waiting for the others.
        """
        args, step_start = self.args, time.perf_counter()
        with self._full_parameters():
            self.weights.start()
            if self.chain is None:  # a new run's chain, from the weights held now
                self.chain = new_chain(
                    args, self.model, self.es_params, self.space, self.optimizer, self._model_source, self._new_adapter
                )
            if self._distance is None:
                self._distance = DistanceFromStart(self.es_params)
            sigma = args.sigma_at(step)
            if args.sigma_decay != 1:  # σ_t for this step's members (the merge space, which has no σ, refuses this)
                self.space.sigma = sigma
            members = self.space.ask(step)
            slots = [None] * (args.es_baseline == "center") + members  # the centre θ first, then the members
            timer = time.perf_counter()
            self.weights.capture()
            times = {"noise": time.perf_counter() - timer}  # the copy of θ counts with the perturbations
            try:
                summaries = self._evaluate_population(rows, step, slots, times)
                timer = time.perf_counter()
                weights, aggregation = self.reward_functions.reward_weights, args.multi_objective_aggregation
                rewards = member_rewards(summaries[len(slots) - len(members) :], weights, aggregation)
                center = summaries[0, SummaryLayout.reward].item() if len(slots) > len(members) else None
                baseline = center if center is not None and center == center else 0.0  # a NaN centre: no baseline
                fitness = shape_fitness(rewards - baseline, args.fitness_shaping)
                record = None
                if fitness is None:  # logged as es/skipped_update = 1; `train` warns once at its end
                    self.weights.restore()
                    outcome = {"es/update_norm": 0.0, "es/skipped_update": 1.0}
                    self._skipped_steps += 1
                else:
                    outcome, record = self.space.tell(members, rewards, fitness, learning_rate)
                    if args.es_optimizer:  # the optimizer applies the gradient estimate `tell` wrote, here
                        rates = [group["lr"] for group in self.optimizer.param_groups]
                        step_optimizer(self.optimizer, self.es_params, rates)
                        record = {**record, "learning_rates": rates}
                    outcome["es/skipped_update"] = 0.0
                self.chain.record(step, record)
                times["update"] = time.perf_counter() - timer
            except BaseException:
                self.weights.restore()
                raise
            times["step"] = time.perf_counter() - step_start
            outcome["es/sigma"] = sigma
            self._log_step(summaries[len(slots) - len(members) :], len(rows), center, outcome, times)
            self.processes.write_shards(self.es_params.values())

    def _evaluate_population(self, rows: list[dict], step: int, slots: list, times: dict) -> torch.Tensor:
        """Evaluate this process's share of the step's slots, in generate calls of `members_per_call` members each,
        and return every slot's summary row (all processes', after the step's one all-reduce)."""
        n = self.args.num_generations
        layout = SummaryLayout(len(self.reward_functions.names), len(rows))
        summaries = torch.zeros(len(slots), layout.width, dtype=torch.float64)
        first_member, error, prompt_tokens = sum(slot is None for slot in slots), None, None
        times |= {"generate": 0.0, "reward": 0.0}
        try:
            generate = self._generator(rows, step)
            mine = self.processes.slots(len(slots))
            per_call = 1 if self.agents and self.agents.generates_itself else self.space.members_per_call(len(mine))
            quiet = self.args.disable_tqdm or not self.is_local_process_zero()
            progress = tqdm(total=len(mine), desc=f"ES step {step + 1}: members", leave=False, disable=quiet)
            for start in range(0, len(mine), per_call):
                part = mine[start : start + per_call]
                seeds = [seed for s in part for seed in self._completion_seeds(step, s - first_member, len(rows))]
                timer = time.perf_counter()
                with self.space.evaluating([slots[s] for s in part]) as route:
                    times["noise"] += time.perf_counter() - timer
                    timer = time.perf_counter()
                    generated = generate(len(part), seeds, route)
                times["generate"] += time.perf_counter() - timer
                timer = time.perf_counter()
                for j, s in enumerate(part):
                    member_completions = generated.select(j * len(rows) * n, (j + 1) * len(rows) * n)
                    if prompt_tokens is None:  # every member meets the same prompts (and environment resets)
                        prompt_tokens = sum(map(len, self.generation.tokenize(member_completions.prompts)))
                    self._score(s, slots[s] is None, step, rows, member_completions, summaries, prompt_tokens)
                times["reward"] += time.perf_counter() - timer
                progress.update(len(part))
            progress.close()
        except Exception as exc:  # reported to the other processes by the all-reduce, then raised
            error = exc
        timer = time.perf_counter()
        summaries = self.processes.exchange(summaries, error, step)
        times["communication"] = time.perf_counter() - timer
        return summaries

    def _generator(self, rows: list[dict], step: int) -> Callable:
        """`generate(n_members, seeds, route)`: the completions of one generate call's members on `rows`, member-major,
        `num_generations` per prompt, completion r sampled with `seeds[r]`: one batched `generate` of the backend,
        or the episodes of an agent run (`trl_es.rollout.episodes`), every turn routed to its member."""
        n, agents = self.args.num_generations, self.agents
        if agents is not None and agents.generates_itself:

            def generate(n_members, seeds, route):
                route(0)  # the call's one member generates every row the rollout function asks for
                return agents.run_rollout_func(rows, n, self, self.generation)

        elif agents is not None:

            def generate(n_members, seeds, route):
                return agents.run(rows, n_members, n, seeds, step, route, self.generation)

        else:
            prompts = [row["prompt"] for row in rows]
            prompt_ids = self.generation.tokenize(prompts)

            def generate(n_members, seeds, route):
                route([j for j in range(n_members) for _ in range(len(rows) * n)])
                batch = [prompts * n_members, prompt_ids * n_members]
                return self.generation.generate(*batch, n, seeds, self.args.log_completion_entropy)

        return generate

    def _completion_seeds(self, step: int, member: int, n_prompts: int) -> list[int]:
        """The sampling seeds of member `member`'s completions at `step` (−1: the centre), one per (prompt,
        generation): with `common_generation_seed` every member's are the same (common random numbers)."""
        key = "common" if self.args.common_generation_seed else "center" if member < 0 else member
        return completion_seeds(sampling_seed(self.args.seed, step, key), n_prompts, self.args.num_generations)

    def _score(self, s: int, is_center: bool, step: int, rows, generated, summaries, prompt_tokens: int) -> None:
        """Score slot `s`'s completions and write its summary row: the member reward R (mean completion reward) and
        the rest `summarize` keeps. Keeps the completions table of this process's first member for `log`."""
        extras = defaultdict(list)
        log_metric = lambda name, value: self._metrics[name].append(value)  # noqa: E731
        per_func = self._rewards(rows, generated, log_metric, lambda column, values: extras[column].extend(values))
        if self.args.mask_truncated_completions:  # cut completions get no reward, as GRPO leaves them out of its loss
            per_func[torch.tensor(generated.truncated, dtype=torch.bool)] = float("nan")
        combined = self.reward_functions.combine(per_func)
        reward = combined.nanmean().item()
        success = (combined >= self.args.success_threshold).double().view(len(rows), -1).mean(1)
        summaries[s] = summarize(
            reward,
            torch.cat([combined[:, None], per_func], dim=1),
            generated.lengths,
            generated.truncated,
            sum(generated.entropy_sums) if generated.entropy_sums else 0.0,
            success,
            sum(generated.tool_calls or ()),
            sum(generated.tool_failures or ()),
            prompt_tokens,
        )
        if not is_center and self._completions_step != step:
            table = {name: per_func[:, k].tolist() for k, name in enumerate(self.reward_functions.names)}
            self._last_completions = (generated.prompts, generated.completions, table, dict(extras))
            self._completions_step = step

    def _log_step(self, members: torch.Tensor, n_prompts: int, center, outcome: dict, times: dict) -> None:
        """The step's metrics, from the members' all-reduced summaries: the same whatever the number of processes.
        `num_tokens` counts, as GRPOTrainer's, the prompt and completion tokens seen so far, here by every member
        (a prompt's tokens once per completion; an agent episode's first prompt, as its environment reset it)."""
        args, metrics = self.args, self._metrics
        if center is not None:
            metrics["es/center_reward"].append(center)
        tools, names = self.agents is not None and bool(self.agents.tools), self.reward_functions.names
        step = population_metrics(
            members, names, n_prompts, args.log_completion_entropy, args.log_population_diversity, tools
        )
        layout = SummaryLayout(len(names), n_prompts)
        tokens = members[:, layout.length("prompt_tokens")].sum() + members[:, layout.length("sum")].sum()
        self.state.num_input_tokens_seen += int(tokens)
        step |= {"num_tokens": self.state.num_input_tokens_seen, "step_time": times["step"]}
        step |= {**outcome, "es/rel_distance_from_start": self._distance()}
        step |= {f"es/time/{name}": times[name] for name in ("generate", "reward", "noise", "update", "communication")}
        for name, value in step.items():
            metrics[name].append(value)

    def _rewards(self, rows: list[dict], generated, log_metric=lambda *_: None, log_extra=lambda *_: None):
        """Each reward function's rewards of `generated`'s completions (GRPOTrainer's contract: `trl_es.rewards`)."""
        repeats = len(generated.completions) // len(rows)
        environments = {} if generated.environments is None else {"environments": generated.environments}
        return self.reward_functions(
            [row for row in rows for _ in range(repeats)],
            generated.prompts,
            generated.completions,
            generated.completion_ids,
            generated.extras,
            trainer_state=self.state,
            log_metric=log_metric,
            log_extra=log_extra,
            **environments,
        )
