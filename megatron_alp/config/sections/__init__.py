"""The sections of a run's config, one module per top-level key of its YAML file (a nested section,
``rollout.sampling`` or ``tir.sandbox``, lives with its parent). :mod:`megatron_alp.config.schema`
composes them into the root :class:`~megatron_alp.config.schema.Config`."""
