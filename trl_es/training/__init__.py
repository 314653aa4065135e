"""Training: `ESConfig` and `ESTrainer` on transformers' Trainer, with the parts the trainer delegates to: the
population's evaluation and metrics (`population`), several processes (`distributed`), logs and evaluation
(`reporting`), checkpoints and saving (`checkpoints`), what training starts from (`loading`), GRPOConfig's fields ES
accepts (`grpo_fields`)."""
