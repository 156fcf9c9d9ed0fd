"""The `megatron-alp` commands, one module each, the session they work in (:mod:`.session`) and the
context they share (:mod:`.context`)."""
