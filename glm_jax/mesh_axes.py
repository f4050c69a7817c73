"""The mesh axis names, shared by the sharding code (which builds meshes from them) and the model code that
runs collectives or shard_maps over them (expert parallelism, the DSA kernels), so the model does not import
the sharding package.

  data    pure data parallelism
  fsdp    data parallelism that also shards parameters and optimizer state
  expert  MoE experts (tokens are split over it too)
  tensor  attention heads, MLP and expert width, vocabulary
"""

DATA, FSDP, EXPERT, TENSOR = "data", "fsdp", "expert", "tensor"
MESH_AXES = (DATA, FSDP, EXPERT, TENSOR)
BATCH_AXES = (DATA, FSDP, EXPERT)  # the axes a batch's leading dimension is split over
