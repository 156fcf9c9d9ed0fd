"""Multi-turn tool-integrated reasoning (TIR): a sandboxed Python interpreter
(:mod:`megatron_alp.tir.sandbox`) and the rollout driver that interleaves model turns with its
outputs (:mod:`megatron_alp.tir.multi_turn`)."""
