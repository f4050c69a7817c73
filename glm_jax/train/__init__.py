"""Pretraining: losses, the jit-compiled step, DSA stages, optimizers, checkpoints, metrics, the loop."""
