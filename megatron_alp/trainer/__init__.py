"""The trainer wing: :class:`~megatron_alp.trainer.trainer.RLTrainer` (the iteration) and the
components it drives, each owning its schedule and resume state (checkpointer, validator, sigma
calibrator); the phase runner, metrics, the run directory, the tiny base model and its warm start."""
