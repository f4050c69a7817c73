r"""One MoE layer's experts at glm5_744b's per-chip sizes, compiled for a v5p slice and costed op by op.

The pod step's MoE layer is dominated by the expert exchange (moe_parallel.expert_parallel_ffn): the ragged
all-to-alls, the grouped matmuls and the copies between them. Compiling the whole 744B step to try a change to
that exchange takes half an hour and 18 GB here; this compiles the routed experts (and the shared expert beside
them), forward and backward, on a slice whose expert axis has the pod's size (8), with the pod's tokens a chip (two
4096-token sequences: 8,192), and prints hlo_cost's figures for it: the serial and the scheduled time, the copies,
and the ops that cost most (balanced routing, the fast path as glm5_744b ships it).

  bash scripts/with_env.sh python experiments/bench_moe_exchange.py                    # v5p:2x2x2, expert 8
  bash scripts/with_env.sh python experiments/bench_moe_exchange.py --shared=0         # the routed experts alone
  bash scripts/with_env.sh python experiments/bench_moe_exchange.py \
      --xla=xla_tpu_enable_async_ragged_all_to_all=true                                 # an XLA:TPU option
  bash scripts/with_env.sh python experiments/bench_moe_exchange.py --hlo=/tmp/moe.hlo   # keep the program's text
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from glm_jax.model.moe_parallel import expert_parallel_ffn
from glm_jax.model.platform import target_platform
from glm_jax.sharding import hlo_cost
from glm_jax.sharding.topology import generation_of, torus_of, tpu_topology_devices
from glm_jax.train.aot import kernel_model, moe_branch, ragged_model

_TOPOLOGY = flags.DEFINE_string("topology", "v5p:2x2x2", "The slice: its chips form the expert axis.")
_TOKENS = flags.DEFINE_integer("tokens", 8192, "Tokens a chip (glm5_744b as shipped: two 4096-token sequences).")
_D = flags.DEFINE_integer("hidden", 6144, "hidden_size")
_I = flags.DEFINE_integer("intermediate", 2048, "moe_intermediate_size")
_E = flags.DEFINE_integer("experts", 256, "n_routed_experts")
_K = flags.DEFINE_integer("topk", 8, "num_experts_per_tok")
_BUFFER = flags.DEFINE_float("buffer_factor", 2.0, "model.moe_buffer_factor (glm5_744b: 2)")
_SHARED = flags.DEFINE_integer(
  "shared", 2048, "The shared expert's intermediate size (glm5_744b: 2048), run beside the routed ones; 0: none."
)
_XLA = flags.DEFINE_multi_string("xla", [], "XLA:TPU options for the compile, name=value (e.g. the async ones).")
_HLO = flags.DEFINE_string("hlo", None, "Write the compiled program's text here.")
_TOP = flags.DEFINE_integer("top", 10, "Ops to list.")


def main(argv):
  del argv
  devices = tpu_topology_devices(_TOPOLOGY.value)
  p = len(devices)
  mesh = jax.sharding.Mesh(np.array(devices), ("expert",))
  n, d, i, e, k = p * _TOKENS.value, _D.value, _I.value, _E.value, _K.value
  bf16 = jnp.bfloat16
  tok = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert", None))
  exp = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert", None, None))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  args = (
    jax.ShapeDtypeStruct((n, d), bf16, sharding=tok),
    jax.ShapeDtypeStruct((n, k), jnp.float32, sharding=tok),
    jax.ShapeDtypeStruct((n, k), jnp.int32, sharding=tok),
    jax.ShapeDtypeStruct((e, d, i), bf16, sharding=exp),
    jax.ShapeDtypeStruct((e, d, i), bf16, sharding=exp),
    jax.ShapeDtypeStruct((e, i, d), bf16, sharding=exp),
    jax.ShapeDtypeStruct((d, 2 * _SHARED.value), bf16, sharding=rep),
    jax.ShapeDtypeStruct((_SHARED.value, d), bf16, sharding=rep),
  )

  def loss(x, w, idx, gate, up, down, shared_in, shared_out):
    y, _ = expert_parallel_ffn(x, w, idx, gate, up, down, bf16, mesh=mesh, buffer_factor=_BUFFER.value)
    if _SHARED.value:  # the shared expert: independent of the exchange, so it may run while rows travel
      g, u = jnp.split(x @ shared_in, 2, axis=-1)
      y = y + (jax.nn.silu(g) * u) @ shared_out
    return jnp.sum(y.astype(jnp.float32) ** 2)

  step = jax.jit(jax.grad(loss, argnums=(0, 3, 4, 5, 6, 7)))
  options = dict(flag.split("=", 1) for flag in _XLA.value)
  with jax.set_mesh(mesh), target_platform("tpu"):
    compiled = step.lower(*args).compile(compiler_options=options or None)
  text = compiled.as_text()
  if _HLO.value:
    with open(_HLO.value, "w") as f:
      f.write(text)
  chip = hlo_cost.Chip.of(generation_of(devices[0]), torus_of(devices))
  rows = _TOKENS.value * k  # balanced routing: every shard's experts get the n*K rows one shard sends
  ops = hlo_cost.program_ops(
    text,
    kernel_model=kernel_model(rows, "balanced"),
    ragged_rows=ragged_model(rows, d),
    chip=chip,
    branch_model=moe_branch("balanced"),
  )
  serial = hlo_cost.summarize(ops)
  scheduled = hlo_cost.schedule(text, ops, chip)
  table = hlo_cost.by_source(ops)
  top = sorted(table.items(), key=lambda kv: -kv[1]["seconds"])[: _TOP.value]
  copies = sum(v["seconds"] for key, v in table.items() if key.startswith("copy"))
  print(
    json.dumps(
      {
        "topology": _TOPOLOGY.value,
        "tokens_per_chip": _TOKENS.value,
        "serial_seconds": round(serial["seconds"], 5),
        "scheduled_seconds": round(scheduled["seconds"], 5),
        "copy_seconds": round(copies, 5),
        "hbm_gb": round(serial["hbm_bytes"] / 1e9, 3),
        "top": [{"op": key, **{f: float(f"{v[f]:.4g}") for f in ("seconds", "hbm_bytes", "flops")}} for key, v in top],
        "buffer_rows": math.ceil(_BUFFER.value * rows / 256) * 256,
      },
      indent=1,
    )
  )


if __name__ == "__main__":
  app.run(main)
