"""Every test process sees 8 simulated CPU devices, so sharding tests run on meshes (DESIGN.md); single-device
code is unaffected (arrays live on device 0). Set before any test module imports jax."""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
