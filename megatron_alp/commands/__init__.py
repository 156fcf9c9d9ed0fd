"""The `megatron-alp` commands, one module each, and the context they share (:mod:`.context`)."""
