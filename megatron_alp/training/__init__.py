"""The Megatron-side training engine: the model build with ALP's perturbation sites, sigma
calibration, logprob and policy-update passes, micro-batches, the RL batch, the optimizer, offload,
distributed checkpoints, MoE routing replay."""
