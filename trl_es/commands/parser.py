"""What every `trl-es` subcommand shares: its argument parser (options spelled with dashes or underscores) and
the one-line report of bad input."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's help with its default; the description as written."""


def command_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The argument parser of a `trl-es` subcommand (options spelled with dashes; `dashed` maps underscores)."""
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)


def dashed(argv: list[str]) -> list[str]:
    """`argv` with every option name spelled with dashes: each subcommand takes `--max_steps` and `--max-steps`
    alike, as `trl-es es` (TRL's parser) does."""
    spelled = []
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name, equals, value = token.partition("=")
            token = name.replace("_", "-") + equals + value
        spelled.append(token)
    return spelled
