"""The one writer of a run's seed chain: started from the weights the run starts training from, one record per ES step,
saved beside every checkpoint and saved model with the tip of the weights saved there, and, when a run resumes,
taken from its checkpoint after checking that the checkpoint's parts belong together and to this run."""

from __future__ import annotations

import hashlib
import os
import warnings

from ..es.weights import weights_hash
from ..util.atomic import atomic_directory
from ..util.compat import is_peft_model
from ..util.models import is_adapter_dir
from .chain import FILE, Chain, Tip, load_chain, new_chain
from .header import base_setup, check_resume, frozen_hash, optimizer_header, run_header


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


BASE_ADAPTER = "base-adapter"
"""The folder of `output_dir` holding the starting adapter of a PeftModel given in memory: the chain's base."""


def optimizer_kind(header: dict | None) -> tuple | None:
    """(module, class, each group's parameter names) of a chain's optimizer header: what optimizer.pt's state fits."""
    if header is None:
        return None
    return header.get("module", "torch.optim"), header["class"], [group["parameters"] for group in header["groups"]]


class ChainRecorder:
    """The seed chain (`chain`, None before training starts) of a run with ESConfig `args`, ES parameters `params`
    and search space `space`, whose model came from `model_source` (`new_adapter`: ESTrainer added its adapter)."""

    def __init__(self, args, params: dict, space, model_source: str, new_adapter: bool):
        self.args, self.params, self.space = args, params, space
        self.model_source, self.new_adapter = model_source, new_adapter
        self.chain: Chain | None = None
        self.changed_settings: dict | None = None  # a resumed run's other settings, recorded with its first step

    def start(self, model, optimizer) -> None:
        """A new run's chain, from the weights `model` holds now (a resumed run continues its checkpoint's). A
        PeftModel given in memory has its starting adapter saved to `<output_dir>/BASE_ADAPTER`, the base the chain
        replays from."""
        if self.chain is not None:
            return
        source = self.model_source
        if is_peft_model(model) and not self.new_adapter and not is_adapter_dir(source):
            source = os.path.abspath(os.path.join(self.args.output_dir, BASE_ADAPTER))
            if self.args.should_save:
                with atomic_directory(source) as staging:
                    model.save_pretrained(staging)
        self.chain = new_chain(self.args, model, self.params, self.space, optimizer, source, self.new_adapter)

    def record(self, step: int, update: dict | None) -> None:
        """The update of ES step `step` (the search space's record; None: no update), with the settings a resumed
        run changed at its first step."""
        self.chain.record(step, update, self.changed_settings)
        self.changed_settings = None

    def tip(self, folder: str) -> Tip | None:
        """What the weights saved in `folder` are, for the chain saved beside them (every process computes it: θ is
        gathered under ZeRO-3); None before the run has a chain."""
        if self.chain is None:
            return None
        tip = {"weights_sha256": weights_hash(self.params)}
        optimizer = os.path.join(folder, "optimizer.pt")
        if self.args.es_optimizer and os.path.isfile(optimizer):
            tip["optimizer_sha256"] = file_sha256(optimizer)
        return tip

    def save(self, folder: str, tip: Tip | None = None) -> None:
        """Write the chain (if the run has one yet) into `folder`, with `tip`."""
        if self.chain is not None:
            self.chain.save(folder, tip)

    def check_resume(self, checkpoint: str, model) -> None:
        """A ValueError, before anything is loaded, unless `checkpoint` holds a seed chain (an ESTrainer checkpoint)
        of a run set up as this one on `model` (`chain.check_resume`); other settings than the checkpoint's (σ,
        population, …) are said and recorded in the chain with the next step."""
        if not os.path.isfile(os.path.join(checkpoint, FILE)):
            raise ValueError(
                f"{checkpoint} is not an ESTrainer checkpoint (it has no {FILE}; a GRPOTrainer checkpoint?): ES "
                "cannot resume another trainer's optimizer and schedule. To start ES from its weights, pass it as the "
                f"model: ESTrainer(model={checkpoint!r}, ...), with a new output_dir"
            )
        expected = run_header(self.args, self.params, self.space, None)
        expected["base"] = base_setup(self.args, model, self.params, self.new_adapter)
        self.changed_settings = check_resume(load_chain(checkpoint), expected, checkpoint) or None
        if self.changed_settings:
            warnings.warn(
                f"resuming {checkpoint} with other settings than it was trained with: {self.changed_settings} (the seed "
                "chain records them from the next step on)",
                stacklevel=4,
            )

    def resume(self, checkpoint: str, model) -> None:
        """Continue the chain of `checkpoint`, whose weights `model` holds now: its ES parameters (and optimizer
        state) must be those its chain was saved with, and the others those the run started from."""
        chain = load_chain(checkpoint)
        tip = chain.tip or {}
        if "weights_sha256" in tip and weights_hash(self.params) != tip["weights_sha256"]:
            raise ValueError(
                f"{checkpoint}: its {FILE} was saved with other weights than the checkpoint's (a file copied from "
                "another run?): the chain would not rebuild this model"
            )
        frozen = chain.header["base"].get("frozen_sha256")
        if frozen is not None and frozen_hash(model, self.params) != frozen:
            raise ValueError(
                f"{checkpoint}: the weights ES does not train (the base of an adapter, or those es_parameter_patterns "
                f"leaves out) are not those the run started from ({chain.header['base']['model']!r}): resume on "
                "the model the run was started with"
            )
        optimizer = os.path.join(checkpoint, "optimizer.pt")
        if "optimizer_sha256" in tip and not (
            os.path.isfile(optimizer) and file_sha256(optimizer) == tip["optimizer_sha256"]
        ):
            raise ValueError(f"{checkpoint}: optimizer.pt is not the optimizer state its {FILE} was saved with")
        self.chain = chain

    def check_optimizer(self, optimizer, checkpoint: str) -> None:
        """A ValueError, before `checkpoint`'s optimizer.pt is loaded into `optimizer`, unless the run resumed trains
        with the optimizer its chain records (`es_optimizer`), over the same parameter groups."""
        recorded = self.chain.header["space"].get("optimizer")
        now = optimizer_header(optimizer, self.params) if self.args.es_optimizer else None
        if optimizer_kind(recorded) != optimizer_kind(now):
            now, recorded = (".".join(kind[:2]) if kind else "none (es_optimizer off)"
                             for kind in (optimizer_kind(now), optimizer_kind(recorded)))  # fmt: skip
            raise ValueError(
                f"resuming {checkpoint} with the optimizer {now} where it was trained with "
                f"{recorded}: its optimizer.pt holds that one's state. Resume with the checkpoint's optim "
                f"and es_optimizer, or start a new run from it with model={checkpoint!r} and a new output_dir"
            )
