"""What a run does and what it needs, worked out once from its resolved config: the run shape
(:mod:`~megatron_alp.plan.shape`: which models exist, which passes and phases run, and when), the
phase table (:mod:`~megatron_alp.plan.phases`) and the per-GPU memory plan. The trainer, the
``plan`` and ``mismatch`` commands read it; it decides nothing twice."""
