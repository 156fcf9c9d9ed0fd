"""Model families (a registry), HF <-> Megatron weight rules and mapping, HF weight I/O, layer specs,
MoE routing capture, tiny test models."""
