"""ESTrainer: Evolution Strategies post-training with GRPOTrainer's contracts. transformers' Trainer supplies data,
logging, callbacks, checkpoints and the Hub; ESTrainer overrides its hooks and holds the ES step (`_es_step`), which
reads top to bottom: ask the search space for the step's members (`trl_es.es.space`) → evaluate this process's share
(`Population`: form, roll out, score) → one all-reduce → tell the search space the rewards (the update rule and the
update) → record the seed chain → log. Trainer's optimizer only carries α_t, unless `es_optimizer` gives it ĝ.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin
from trl.trainer.utils import get_config_model_id, identity

from ..chains.recorder import ChainRecorder
from ..es import search_space
from ..generation import make_backend
from ..rewards import RewardFunctions
from ..rollout import Agents, make_rollout
from ..util.compat import BaseTrainer, check_trainer_hooks, trainer_takes_quantized
from ..util.models import is_quantized_model, load_starting_model
from .checkpoints import SavingMixin
from .checks import check_arguments, check_eval_dataset, check_optimizer_parameters, check_setup, check_vision
from .config import ESConfig
from .distributed import Processes, engine_size
from .loading import (
    DataMixin,
    es_candidates,
    eval_datasets,
    keep_theta_in_float32,
    prepare_model,
    run_facts,
    training_dataset,
)
from .population import Population
from .reporting import ReportingMixin
from .steplog import StepLog


check_trainer_hooks()


class ESTrainer(ReportingMixin, SavingMixin, DataMixin, BaseTrainer):
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
            the reward functions read; for a vision-language model, an "image" or "images" column too.
        eval_dataset (`Dataset`, *optional*): prompts for `evaluate` (Pass@K, Maj@K, reward).
        processing_class (`PreTrainedTokenizerBase` or `ProcessorMixin`, *optional*): the tokenizer, or a
            vision-language model's processor; default: the model's (AutoProcessor for a vision-language model).
        reward_processing_classes (*optional*): tokenizers of reward models, as in GRPOTrainer.
        callbacks (*optional*): Trainer callbacks.
        optimizers (*optional*): (optimizer, scheduler), as in GRPOTrainer; with `args.es_optimizer` only, the
            optimizer steps on the ES gradient estimate and must hold every parameter ES trains.
        quantization_config (`transformers.BitsAndBytesConfig`, *optional*): quantizes a model loaded from an id or
            path, as in GRPOTrainer; ES then trains an adapter on it (`peft_config` or `args.es_adapter_only`).
        peft_config (`peft.PeftConfig`, *optional*): a new adapter; ES then perturbs its weights only.
        tools, environment_factory (*optional*): agent episodes, as in GRPOTrainer (`trl_es.rollout.episodes`).
        rollout_func (*optional*): `rollout_func(prompts, trainer)`, the user's own generation, as in GRPOTrainer.
        optimizer_cls_and_kwargs (*optional*): (optimizer class, its kwargs), as Trainer takes it: the optimizer
            `es_optimizer` builds over the trained parameters (e.g. those of the adapter ESTrainer adds).

    Example (the README's quick start runs offline on SmolLM2):

    ```python
    trainer = ESTrainer(
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        reward_funcs=reward_correct,  # as for GRPOTrainer
        args=ESConfig(output_dir="es-out", population_size=8, sigma=3e-3, learning_rate=2e-3, max_steps=10),
        train_dataset=dataset,  # a "prompt" column and the columns the rewards read
    )
    trainer.train()
    ```
    """

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs=None,
        args: ESConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset=None,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin | None = None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        quantization_config=None,
        peft_config=None,
        tools: list[Callable] | None = None,
        rollout_func: Callable | None = None,
        environment_factory=None,
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict] | None = None,
    ):
        args = check_arguments(
            model, args, optimizers, optimizer_cls_and_kwargs, tools, environment_factory, rollout_func
        )
        train_dataset = training_dataset(train_dataset, args, environment_factory)
        if eval_dataset is not None:
            check_eval_dataset(eval_dataset, train_dataset)
        model_source = model if isinstance(model, str) else get_config_model_id(model.config)
        model, processing_class, eos_ids = prepare_model(
            model, args, processing_class, peft_config, quantization_config
        )
        check_vision([train_dataset, *eval_datasets(eval_dataset)], processing_class, model, args)
        agents = bool(tools) or environment_factory is not None
        self.agents = Agents(processing_class, args, tools, environment_factory) if agents else None
        self.reward_functions = RewardFunctions(
            reward_funcs, args.reward_weights, reward_processing_classes, args.model_init_kwargs,
            args.trust_remote_code, args.chat_template_kwargs, owned=self.agents.reward_funcs if agents else (),
        )  # fmt: skip
        environments = agents and self.agents.environments
        columns = getattr(train_dataset, "column_names", None)
        self.reward_functions.check_signatures(columns, environments, rollout_func is not None)
        with trainer_takes_quantized(model, integers=args.es_search_space == "qes"):
            super().__init__(
                model=model,
                args=args,
                data_collator=identity,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                callbacks=callbacks,
                optimizers=optimizers,
                optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            )
        zero_stage = self._set_up_processes()
        self._set_up_es(processing_class, eos_ids, rollout_func, zero_stage)
        self.chain_recorder = ChainRecorder(args, self.es_params, self.space, model_source, peft_config is not None)
        # The step's state, all of it (the saves' is `SavingMixin`'s): what the steps record (metrics, skipped steps,
        # loss, distance from the start), the prompts of the micro-batches an accumulating step has gathered so far,
        # and the placeholder parameter that carries α_t's schedule when no optimizer steps on ĝ (`create_optimizer`).
        self.step_log = StepLog(self.es_params)
        self._pending_rows: list[dict] = []
        self._lr_holder: torch.nn.Parameter | None = None

    def _set_up_processes(self) -> int | None:
        """The run's processes (`Processes`), with Trainer's DeepSpeed and FSDP paths taken over; returns the ZeRO
        stage (None without DeepSpeed). ESTrainer prepares the model itself (`_prepare_for_training`): Trainer's
        DeepSpeed and FSDP paths build a training engine or wrapper, save engine checkpoints and gather through it,
        none of which applies to ES. FSDP's processes run unwrapped, θ whole on each (docs/scaling.md)."""
        args = self.args
        zero_stage = self.accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else None
        self.is_deepspeed_enabled = False
        slots = Population.slot_count(args)
        self.processes = Processes(self.accelerator, zero_stage, args.ddp_timeout, slots, engine_size(args))
        if self.processes.fsdp_launch():
            self.is_fsdp_enabled = False
            if not is_quantized_model(self.model):
                self.processes.share_weights(self.model)
        return zero_stage

    def _set_up_es(self, processing_class, eos_ids: list[int], rollout_func, zero_stage: int | None) -> None:
        """What an ES step runs on: the ES parameters θ the search space selects (float32 under mixed precision; an
        8-bit model's int8 weights for QES), the run's facts (refused
        here when the set-up cannot honour them), the generation and weights backends, the search space, the rollout
        and the population."""
        args = self.args
        self.model.add_model_tags(self._tag_names)
        self.reward_functions.to(self.accelerator.device)
        patterns, space = args.es_parameter_patterns, search_space(args.es_search_space)
        self.es_params = space.parameters(es_candidates(self.model, patterns), patterns)
        keep_theta_in_float32(self.es_params, self.accelerator.mixed_precision)
        self.facts = run_facts(self.model, processing_class, self.es_params, args, self.accelerator, zero_stage)
        check_setup(args, self.facts)
        backend = (self.model, processing_class, eos_ids, args, self.accelerator, self.es_params, self.facts)
        self.generation, self.weights = make_backend(*backend)
        self.space = space.build(args, self.model, self.weights, load_starting_model, zero_stage)
        self.rollout = make_rollout(self.generation, self.agents, rollout_func, self)
        if self.agents is not None:
            self.agents.check_reproducible(next(iter(self.train_dataset)), args.seed)
        parts = (self.space, self.rollout, self.reward_functions, self.processes, self.generation.tokenize)
        self.population = Population(args, *parts)

    chain = property(lambda self: self.chain_recorder.chain, doc="The run's seed chain (`trl_es.chains.Chain`).")

    # GRPOTrainer's public attributes, with the same meaning
    reward_funcs = property(lambda self: self.reward_functions.funcs, doc="The reward functions and models.")
    reward_func_names = property(lambda self: self.reward_functions.names, doc="Their names, as in the logs.")
    reward_weights = property(lambda self: self.reward_functions.reward_weights, doc="Their weights (float32).")
    reward_processing_classes = property(lambda self: self.reward_functions.processing_classes)  # their tokenizers

    # ---- Trainer plumbing -------------------------------------------------------------------------------------

    def create_optimizer(self, model=None):
        """With `es_optimizer`, Trainer's optimizer (from `optimizers`, `optimizer_cls_and_kwargs` or `optim`), which
        the update rule steps on ĝ (`SearchSpace.tell`); it must hold every ES parameter. Otherwise a placeholder SGD
        over one scalar that never gets a gradient: the plain update keeps no state, the scheduler drives α_t."""
        if self.args.es_optimizer:
            optimizer = super().create_optimizer(model)
            check_optimizer_parameters(optimizer, self.es_params)
            return optimizer
        if self.optimizer is None:
            self._lr_holder = torch.nn.Parameter(torch.zeros((), device=self.args.device))
            self.optimizer = torch.optim.SGD([self._lr_holder], lr=self.args.learning_rate)
        return self.optimizer

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """Trainer's hook (see `compat.TRAINER_HOOKS`) that wraps the model and builds the optimizer and scheduler; ES
        never back-propagates, so the model is prepared for inference only (`Processes.prepare`). Then, once per
        `train`, the run starts from the weights held: the weights backend, the seed chain and θ₀."""
        if getattr(self, "_created_lr_scheduler", False):
            self.lr_scheduler, self._created_lr_scheduler = None, False
        self.create_optimizer()
        if self.args.es_optimizer:  # the update rule steps it on the gradient estimate (`SearchSpace.tell`)
            self.space.rule.use_optimizer(self.optimizer)
        self.create_scheduler(num_training_steps=max_steps, optimizer=self.optimizer)
        self.model_wrapped = self.processes.prepare(self.model, self.model_wrapped)
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        with self._full_parameters():  # the run starts from the weights held now (a resumed run: its checkpoint's)
            self.weights.start()  # vLLM receives θ
            self.chain_recorder.start(self.model, self.optimizer)  # a new run's chain (a resumed one continues)
            self.space.rule.hold_anchor(self.es_params)  # θ₀ of the anchored decay: the chain's base
        return self.model_wrapped, train_dataloader

    def _full_parameters(self):
        """Context in which this process holds all of θ (gathered under ZeRO-3)."""
        return self.processes.full_parameters(self.model, self.model_wrapped)

    def floating_point_ops(self, inputs) -> int:
        return 0  # no forward/backward FLOPs in Trainer's sense

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Trainer's micro-batch. The `gradient_accumulation_steps` micro-batches of an update (fewer at an epoch's
        end) make one ES step on all their prompts, taken at the last of them, when Trainer steps its optimizer.
        Returns the step's loss, −`reward` (its mean population reward; NaN when no completion got one), and 0 for
        the micro-batches before the last."""
        self._pending_rows += inputs
        if not self.accelerator.sync_gradients:
            return torch.zeros((), device=self.args.device)
        rows, self._pending_rows = self._pending_rows, []
        scheduler = self.lr_scheduler
        learning_rate = scheduler.get_last_lr()[0] if scheduler is not None else self.args.learning_rate
        loss = self._es_step(rows, self.state.global_step, learning_rate)
        return torch.tensor(loss, device=self.args.device)

    def train(self, *args, **kwargs):
        try:
            self.lock_output_dir()
            self.step_log.start_run()
            self._pending_rows = []
            self.accelerator.print(self.population.cost(), file=sys.stderr, flush=True)  # on the main process
            output = super().train(*args, **kwargs)
            if self.state.global_step == 0:
                raise ValueError("no ES step ran: the training dataset gave no prompts (is it empty?)")
            self.step_log.warn_skipped()
            output.metrics["train_loss"] = self.step_log.training_loss  # Trainer's own averages the step losses
            return output._replace(training_loss=output.metrics["train_loss"])
        finally:
            self.weights.release()  # the copy of θ and the noise table, rebuilt from the seed when needed
            self.unlock_output_dir()

    # ---- The ES step ------------------------------------------------------------------------------------------

    def _es_step(self, rows: list[dict], step: int, learning_rate: float) -> float:
        """One ES step: ask → evaluate this process's slots → all-reduce → tell (the update rule) → record → log.
        Returns the step's loss, −(mean population reward).

        On any exception, KeyboardInterrupt included, θ is restored bitwise. A failure on one process is reported to
        all at the all-reduce, so every process restores θ and raises instead of waiting for the others.
        """
        step_start = time.perf_counter()
        with self._full_parameters():
            self.step_log.begin_step()
            members = self.space.ask(step)
            timer = time.perf_counter()
            self.weights.capture()
            times = {"noise": time.perf_counter() - timer}  # the copy of θ counts with the perturbations
            try:
                summaries, rewards, center = self.population.evaluate(
                    rows, step, members, times, trainer_state=self.state, log_metric=self.step_log.add
                )
                timer = time.perf_counter()
                outcome, record = self.space.tell(members, rewards, learning_rate, center)
                self.chain_recorder.record(step, record)
                times["update"] = time.perf_counter() - timer
            except BaseException:
                self.weights.restore()
                raise
            times["step"] = time.perf_counter() - step_start
            outcome["es/sigma"] = self.space.rule.sigma_at(step)
            loss = self.step_log.record(self._step_metrics(summaries, len(rows), center, outcome, times))
            self.processes.write_shards(self.es_params.values())
        return loss
