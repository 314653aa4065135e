"""The one writer of a run's seed chain: started from the weights at the run's first step, one record per ES step,
saved beside every checkpoint and saved model with the tip of the weights saved there, and, when a run resumes,
taken from its checkpoint after checking that the checkpoint's parts belong together and to this run."""

from __future__ import annotations

import hashlib
import os

from ..es.weights import weights_hash
from .chain import FILE, Chain, Tip, check_resume, load_chain, new_chain, run_header


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class ChainRecorder:
    """The seed chain (`chain`, None before the first step) of a run with ESConfig `args`, ES parameters `params`
    and search space `space`, whose model came from `model_source` (`new_adapter`: ESTrainer added its adapter)."""

    def __init__(self, args, params: dict, space, model_source: str, new_adapter: bool):
        self.args, self.params, self.space = args, params, space
        self.model_source, self.new_adapter = model_source, new_adapter
        self.chain: Chain | None = None

    def start(self, model, optimizer) -> None:
        """A new run's chain, from the weights `model` holds now (a resumed run continues its checkpoint's)."""
        if self.chain is None:
            self.chain = new_chain(
                self.args, model, self.params, self.space, optimizer, self.model_source, self.new_adapter
            )

    def record(self, step: int, update: dict | None) -> None:
        """The update of ES step `step` (the search space's record; None: no update)."""
        self.chain.record(step, update)

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

    @staticmethod
    def require(checkpoint: str) -> None:
        """A ValueError, before anything is loaded, unless `checkpoint` holds a seed chain (an ESTrainer
        checkpoint)."""
        if not os.path.isfile(os.path.join(checkpoint, FILE)):
            raise ValueError(
                f"{checkpoint} is not an ESTrainer checkpoint (it has no {FILE}; a GRPOTrainer checkpoint?): ES "
                "cannot resume another trainer's optimizer and schedule. To start ES from its weights, pass it as the "
                f"model: ESTrainer(model={checkpoint!r}, ...)"
            )

    def resume(self, checkpoint: str) -> None:
        """Continue the chain of `checkpoint`, whose weights this process holds now: its weights (and optimizer
        state) must be those its chain was saved with, and this run must record the same kind of updates
        (`check_resume`)."""
        chain = load_chain(checkpoint)
        check_resume(chain, run_header(self.args, self.params, self.space, None), checkpoint)
        tip = chain.tip or {}
        if "weights_sha256" in tip and weights_hash(self.params) != tip["weights_sha256"]:
            raise ValueError(
                f"{checkpoint}: its {FILE} was saved with other weights than the checkpoint's (a file copied from "
                "another run?): the chain would not rebuild this model"
            )
        optimizer = os.path.join(checkpoint, "optimizer.pt")
        if "optimizer_sha256" in tip and not (
            os.path.isfile(optimizer) and file_sha256(optimizer) == tip["optimizer_sha256"]
        ):
            raise ValueError(f"{checkpoint}: optimizer.pt is not the optimizer state its {FILE} was saved with")
        self.chain = chain
