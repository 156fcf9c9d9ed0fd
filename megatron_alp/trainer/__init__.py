"""The trainer wing: :class:`~megatron_alp.trainer.trainer.RLTrainer` (the iteration), its phases and
metrics, the run directory, the tiny base model and its warm start."""
