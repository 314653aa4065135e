"""Built-in tasks: datasets with a "prompt" column plus answer columns, and TRL-signature reward functions."""

from .arithmetic import first_integer_reward, small_sums
from .countdown import countdown, countdown_reward

__all__ = ["countdown", "countdown_reward", "first_integer_reward", "small_sums"]
