"""Meshes, logical axis rules, sharded state, and compile-only TPU topologies."""
