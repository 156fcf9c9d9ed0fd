"""megatron-alp: Megatron-Core RL training with Adaptive Layerwise Perturbation (ALP).

The package is in wings whose imports run one way (docs/architecture.md): commands, the trainer,
the config resolution, batch sources and diagnostics, the training engine / rollout / TIR, the
algorithms / models / data / rewards, the config schema, the runtime.
"""
