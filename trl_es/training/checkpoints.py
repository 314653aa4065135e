"""How ESTrainer writes and reads what outlives a run: checkpoints, the saved model, its model card.

A mixin of `ESTrainer` over transformers' Trainer: Trainer writes the weights, trainer state, scheduler and RNG
states; ESTrainer adds the search space's own state to each checkpoint, gathers θ under ZeRO-3 to save or load it,
hands a loaded checkpoint to the weights backend (vLLM takes it at its next start), and appends the ES settings to
TRL's model card (plus the sparse delta's statistics with `sparse_delta_tau`).

Every checkpoint and saved model carries the run's seed chain, `es_chain.json` (`trl_es.chains`): the updates of
every step, from which the weights can be rebuilt from the starting model; a resumed run continues its checkpoint's
chain. With the anchored decay (`es_anchor_decay`), a checkpoint also keeps θ₀, the weights the run (and its chain)
started from, over the ES parameters (`ANCHOR_FILE`): a resumed run pulls toward exactly them, checked against the
chain's base SHA-256 (one extra copy of the ES parameters per checkpoint on disk, and in host memory during the
run). `push_to_hub(chain_only=True)` publishes just the chain and a model card saying how to replay it.

Every save is atomic (`trl_es.util.atomic`): a checkpoint is written whole into
`<output_dir>/.staging/checkpoint-K`, flushed to disk and renamed to `checkpoint-K`, and only then are older
checkpoints rotated away, so a crash at any moment leaves every `checkpoint-K` complete and
`resume_from_checkpoint=True` (the newest one) resumable (a `checkpoint-K` written again is moved aside first; one a
crash left there is put back when the next run starts); a saved model's files appear together or not at all (a crash
among them is finished when the next run starts). A run holds a lock on its `output_dir` (`.trl-es.lock`), so a
second run writing into the same directory is refused rather than mixing its checkpoints with the first's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from transformers.trainer_utils import rotate_checkpoints
from trl.trainer.utils import get_config_model_id

from ..chains import FILE as CHAIN_FILE
from ..chains import Chain
from ..es.weights import weights_hash
from ..util import deltas
from ..util.atomic import (
    atomic_directory,
    atomic_write_text,
    clear_crashed_staging,
    publish_directory,
    restore_replaced,
)
from .config import marked


STAGING = ".staging"
"""The folder of `output_dir` where a checkpoint is written before it is renamed into place."""


LOCK = ".trl-es.lock"
"""The file of `output_dir` a training run holds an exclusive lock on (`SavingMixin.lock_output_dir`)."""


ANCHOR_FILE = "es_anchor.safetensors"
"""The file of a checkpoint holding θ₀ of the anchored decay (`es_anchor_decay`): the ES parameters' starting
weights."""


def load_anchor(checkpoint: str, params: dict) -> dict:
    """θ₀ from `checkpoint`'s `ANCHOR_FILE`, holding each of `params` (the ES parameters) with its shape and dtype."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.path.join(checkpoint, ANCHOR_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: the anchored decay (es_anchor_decay) pulls toward the run's starting weights, which "
            "its checkpoints keep there. Resume from a complete checkpoint of this run"
        )
    try:
        anchor = load_file(path)
    except (OSError, SafetensorError) as error:
        raise ValueError(f"{path} is not a readable safetensors file of the starting weights: {error}") from error
    wrong = sorted(set(anchor) ^ set(params)) or [
        name for name, p in params.items() if (anchor[name].shape, anchor[name].dtype) != (p.shape, p.dtype)
    ]
    if wrong:
        raise ValueError(f"{path} does not hold this run's ES parameters ({wrong[0]!r} differs)")
    return anchor


class SavingMixin:
    """Checkpoints, `save_model` and the model card of `ESTrainer` (see the module docstring)."""

    # TRL's model card: its tags, the method's name and paper
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

    # The saves' state: the lock held on output_dir, whether a checkpoint is being staged, and the statistics of the
    # sparse delta `save_model` wrote last (for the model card), if any.
    _lock = None
    _staging_checkpoint = False
    _sparse_delta_card: dict | None = None

    def lock_output_dir(self) -> None:
        """Hold an exclusive `flock` on `<output_dir>/.trl-es.lock` for the run (main process): a second run writing
        checkpoints into the same directory (a requeued job while the old one still runs) is refused instead of
        interleaving its staged files with the first's. The operating system releases it when the process dies.
        Holding it, the run repairs what a crashed one left: a replaced checkpoint, a save cut short."""
        if not self.args.should_save or self._lock is not None:
            return
        import fcntl

        os.makedirs(self.args.output_dir, exist_ok=True)
        lock = open(os.path.join(self.args.output_dir, LOCK), "a+")  # noqa: SIM115 - held for the run
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            lock.close()
            raise RuntimeError(
                f"output_dir {self.args.output_dir!r} is being written by another training run (process {holder}): "
                "two runs checkpointing into one directory would overwrite each other's checkpoints. Stop the other "
                "run, or give this one another output_dir."
            ) from None
        lock.seek(0), lock.truncate(), lock.write(str(os.getpid())), lock.flush()
        self._lock = lock
        restore_replaced(self.args.output_dir)  # a checkpoint a crash left moved aside, findable again
        clear_crashed_staging(self.args.output_dir)  # a save_model a crash cut short, finished

    def unlock_output_dir(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(OSError):
                os.remove(self._lock.name)
            self._lock.close()  # closing the file releases the lock
            self._lock = None

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Trainer's checkpoint loading (under ZeRO-3 into the gathered θ, keeping this process's slice), then the
        seed chain, the weights backend and the search space take the checkpoint's state."""
        self.chain_recorder.check_resume(resume_from_checkpoint, self.model)
        with self._full_parameters():
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            self.processes.write_shards(self.model.parameters())
            self.chain_recorder.resume(resume_from_checkpoint, self.model)
            if self.space.rule.anchor_decay:
                self._load_anchor(resume_from_checkpoint)
        self.weights.loaded(resume_from_checkpoint)
        self.space.load_state(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """Trainer's, once the optimizer built is the one the checkpoint's state belongs to."""
        if checkpoint is not None:
            self.chain_recorder.check_optimizer(self.optimizer, checkpoint)
        super()._load_optimizer_and_scheduler(checkpoint)

    def _load_anchor(self, checkpoint: str) -> None:
        """θ₀ of the anchored decay from `checkpoint`, checked to be the weights its seed chain starts from: with the
        model's other parameters, which ES never moves, it hashes to the chain's base SHA-256."""
        anchor = load_anchor(checkpoint, self.es_params)
        if weights_hash({**dict(self.model.named_parameters()), **anchor}) != self.chain.header["base"]["sha256"]:
            raise ValueError(
                f"{checkpoint}: {ANCHOR_FILE} is not the weights this run started from (its {CHAIN_FILE} names "
                "another base): resume from a checkpoint of one run, whose files belong together"
            )
        self.space.rule.load_state_dict(anchor)

    def _get_output_dir(self, trial) -> str:
        """Trainer's run directory; while a checkpoint is written, its staging folder (`STAGING`)."""
        run_dir = super()._get_output_dir(trial)
        return os.path.join(run_dir, STAGING) if self._staging_checkpoint else run_dir

    def _save_checkpoint(self, model, trial):
        """Trainer's checkpoint plus the search space's state, written into the staging folder by every process,
        then published by the main process in one rename; older checkpoints are rotated only after that."""
        # The steps since the last log reach the checkpoint's trainer state as a record of their own, while the run
        # keeps them for its next log (GRPOTrainer's records: the last window folds into the final summary).
        pending = {**self.step_log.pending(), "step": self.state.global_step} if self.step_log.window else None
        if pending:
            self.state.log_history.append(pending)
        try:
            self._write_checkpoint(model, trial)
        finally:
            if pending:
                self.state.log_history.remove(pending)

    def _write_checkpoint(self, model, trial):
        run_dir, name = self._get_output_dir(trial), f"checkpoint-{self.state.global_step}"
        staging = os.path.join(run_dir, STAGING, name)
        if self.args.should_save:  # this run holds the directory's lock: what is in the staging, a crash left
            shutil.rmtree(os.path.join(run_dir, STAGING), ignore_errors=True)
            os.makedirs(staging)
        self.accelerator.wait_for_everyone()
        self._staging_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_checkpoint = False
        with self._full_parameters():  # every process takes part in gathering θ under ZeRO-3
            tip = self.chain_recorder.tip(staging)
        if self.args.should_save:
            self.space.save_state(staging)
            rule_state = self.space.rule.state_dict()
            if rule_state:
                from safetensors.torch import save_file

                save_file(rule_state, os.path.join(staging, ANCHOR_FILE))
            self.chain_recorder.save(staging, tip)
        self.accelerator.wait_for_everyone()  # every process's files (e.g. its RNG state) are in
        if self.args.should_save:
            publish_directory(staging, os.path.join(run_dir, name))
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(run_dir, STAGING))  # empty now
            limit, best = self.args.save_total_limit, self.state.best_model_checkpoint
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit, best_model_checkpoint=best, use_mtime=True)
        self.accelerator.wait_for_everyone()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the model with HF names, atomically (the main process writes; under ZeRO-3 every process takes
        part in gathering θ, so call it on every process, as Trainer does). A save that writes no sparse delta
        removes the one an earlier save left in `output_dir`: a delta there always belongs to the model beside it."""
        output_dir = output_dir or self.args.output_dir
        with self._full_parameters():
            if self._staging_checkpoint or not self.args.should_save:  # a checkpoint is staged as a whole
                super().save_model(output_dir, _internal_call)
            else:
                with atomic_directory(output_dir) as staging:
                    super().save_model(staging, _internal_call=True)  # Trainer pushes below, once published
                    self.chain_recorder.save(staging, self.chain_recorder.tip(staging))
                    self._sparse_delta_card = None
                    if self.args.sparse_delta_tau is not None:
                        self._sparse_delta_card = deltas.write_model_delta(
                            self.model, staging, self.args.sparse_delta_tau
                        )
                    if self._sparse_delta_card is None:  # an earlier save's delta would not rebuild this model
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(os.path.join(output_dir, deltas.DELTA_FILE))
        if not _internal_call and os.path.abspath(output_dir) == os.path.abspath(self.args.output_dir):
            self.create_model_card()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's model card (tags trl, trl-es, evolution-strategies) plus the base model and ES settings. Not pushed
        to the Hub, the card is named after `output_dir`, its quick start loads that folder, and a local base is named
        as given (TRL's card would say None for each)."""
        args, hub_model_id = self.args, self.hub_model_id
        self.hub_model_id = hub_model_id or args.output_dir
        try:
            model_name = model_name or os.path.basename(os.path.abspath(args.output_dir))
            super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        finally:
            self.hub_model_id = hub_model_id
        if not self.is_world_process_zero():
            return
        path = os.path.join(args.output_dir, "README.md")
        with open(path, encoding="utf-8") as card:
            text = card.read().replace("[None](https://huggingface.co/None)", f"`{self.chain_recorder.model_source}`")
        settings = {
            "base model": get_config_model_id(self.model.config),
            **{name: getattr(args, name) for name in marked("card")},
            "prompts per step": args.per_device_train_batch_size * args.gradient_accumulation_steps,
            "steps": self.state.global_step,
            "reward functions": ", ".join(self.reward_functions.names),
            **(self._sparse_delta_card or {}),
        }
        cell = lambda value: str(value).replace("|", "\\|").replace("\n", " ")  # noqa: E731 - one cell: `(q|v)_proj`
        rows = "\n".join(f"| {k} | `{cell(v)}` |" for k, v in settings.items())
        text += f"\n## Evolution Strategies settings\n\n| setting | value |\n|---|---|\n{rows}\n"
        atomic_write_text(path, text)

    def push_to_hub(self, commit_message="End of training", blocking=True, token=None, revision=None, **kwargs):
        """Trainer's `push_to_hub`; with `chain_only=True`, only `es_chain.json` and a model card naming the base
        and the two-line replay go to `hub_model_id` (or `<output_dir name>`): a few kilobytes instead of the
        weights."""
        if not kwargs.pop("chain_only", False):
            return super().push_to_hub(commit_message, blocking, token, revision, **kwargs)
        if self.chain is None:
            raise ValueError("no seed chain yet: push_to_hub(chain_only=True) comes after training")
        if not self.is_world_process_zero():
            return None
        from huggingface_hub import HfApi

        api, repo = (
            HfApi(token=token or self.args.hub_token),
            self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir)),
        )
        repo_id = api.create_repo(repo, private=self.args.hub_private_repo, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as folder:
            self.chain.save(folder)
            with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as card:
                card.write(chain_card(self.chain, repo_id, os.path.getsize(os.path.join(folder, CHAIN_FILE))))
            return api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message,
                                     revision=revision or self.args.hub_revision)  # fmt: skip


def chain_card(chain: Chain, repo_id: str, size: int) -> str:
    """The model card of a chain-only repository."""
    base = chain.header["base"]
    updates = sum(entry["update"] is not None for entry in chain.steps)
    return (
        f"---\ntags: [trl, trl-es, evolution-strategies, es-chain]\nbase_model: {base['model']}\n---\n\n"
        f"# {repo_id}: an ES seed chain\n\nThis repository holds no weights: `es_chain.json` ({size / 1024:.1f} KiB) "
        f"records {len(chain.steps)} ES steps ({updates} updates) of a run that started from `{base['model']}` "
        f"(weights SHA-256 `{base['sha256']}`). Replay rebuilds the trained model bitwise on the device type and "
        "dtype of training:\n\n```bash\npip install trl-es\n"
        f"trl-es replay --base {base['model']} --chain {repo_id} --out model\n```\n"
    )
