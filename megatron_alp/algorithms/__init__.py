"""Algorithm math, torch only: the policy losses (a registry), GRPO advantages, dynamic sampling,
balancing work over ranks and replicas, engine-trainer mismatch statistics, pass@k."""
