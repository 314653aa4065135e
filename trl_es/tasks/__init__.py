"""Built-in tasks: datasets with a "prompt" column plus answer columns, and TRL-signature reward functions."""

from .arithmetic import first_integer_reward, small_sums

__all__ = ["first_integer_reward", "small_sums"]
