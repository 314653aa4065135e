"""The `trl-es` subcommands, one module each (`trl_es.cli` dispatches to them); `parser` is what they share."""
