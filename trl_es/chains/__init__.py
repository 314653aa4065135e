"""Seed chains: a whole ES run as a few kilobytes that rebuild the trained model bitwise (`chain`: the format,
loading and replay; `header`: what a run records and a resume must match; `validation`: a file's checks)."""

from .chain import FILE, FORMAT, Base, Chain, Header, StepRecord, Tip, load_base, load_chain, new_chain, replay
from .header import check_resume, run_header


__all__ = [
    "FILE",
    "FORMAT",
    "Base",
    "Chain",
    "Header",
    "StepRecord",
    "Tip",
    "check_resume",
    "load_base",
    "load_chain",
    "new_chain",
    "replay",
    "run_header",
]
