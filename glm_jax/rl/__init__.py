"""Post-training: GRPO with IcePop, on-policy distillation, asynchronous rollouts (GLM5_FACTS section 5)."""
