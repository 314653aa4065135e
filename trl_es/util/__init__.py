"""What every layer above the algorithm shares: the register of private TRL/transformers names (`compat`), atomic
saves (`atomic`), and loading models, SmolLM2 offline included (`models`)."""
