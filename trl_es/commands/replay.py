"""`trl-es replay`: the trained model rebuilt bitwise from the starting model and the seed chain
(`trl_es.chains`)."""

from __future__ import annotations

import os

from ..chains import load_chain, replay
from .parser import command_parser


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("trl-es replay", "Rebuild a trained model from its seed chain.")
    parser.add_argument("--chain", required=True, help="es_chain.json, a folder holding it, or a Hub repository id")
    parser.add_argument("--base", help="the model training started from (default: the one the chain names)")
    parser.add_argument("--out", required=True, help="a new directory for the rebuilt model")
    parser.add_argument("--steps", type=int, help="replay the first STEPS steps only (checkpoint-STEPS's weights)")
    parser.add_argument("--force", action="store_true", help="replay even if the base weights' SHA-256 differs (and "
                        "keep a result that misses the chain's tip)")  # fmt: skip
    options = parser.parse_args(argv)
    chain = load_chain(options.chain)
    base = chain.header["base"]
    base = options.base or (base["path"] if base.get("path") and os.path.isdir(base["path"]) else base["model"])
    replay(chain, base, options.out, options.steps, options.force)
    print(f"Model after {chain.span()[1] if options.steps is None else options.steps} steps saved to {options.out}.")
