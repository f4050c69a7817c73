"""The mesh axis names, shared by the sharding code (which builds meshes from them) and the model code that
runs collectives or shard_maps over them (expert parallelism, the DSA kernels), so the model does not import
the sharding package.

  data    pure data parallelism
  fsdp    data parallelism that also shards parameters and optimizer state
  expert  MoE experts (tokens are split over it too)
  context the sequence: each device holds a share of every sequence's tokens (context parallelism,
          glm_jax/model/context_parallel.py); parameters are split over it as over fsdp
  tensor  attention heads, MLP and expert width, vocabulary
"""

DATA, FSDP, EXPERT, CONTEXT, TENSOR = "data", "fsdp", "expert", "context", "tensor"
MESH_AXES = (DATA, FSDP, EXPERT, CONTEXT, TENSOR)
BATCH_AXES = (DATA, FSDP, EXPERT)  # the axes a batch's leading dimension is split over
TOKEN_AXES = BATCH_AXES + (CONTEXT,)  # the axes a flattened [B * T] token dimension is split over
