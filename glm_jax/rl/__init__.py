"""Post-training: GRPO with IcePop, on-policy distillation, asynchronous rollouts (docs/glm5_facts.md section 5)."""
