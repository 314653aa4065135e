"""TRL-compatible reward functions and the contract by which ESTrainer calls them."""

from .contract import RewardFunctions


__all__ = ["RewardFunctions"]
