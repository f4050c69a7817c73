r"""Weight bytes of a config's model under each quantization scheme, from the packed parameters' shapes.

  bash scripts/with_env.sh python experiments/quant_memory.py --config=configs/glm5_744b.py --chips=64,256,512

Packs the model abstractly (jax.eval_shape: nothing is allocated) under each scheme of
glm_jax/model/quantization.py and sums the stored bytes: int8 or two-to-a-byte int4 codes, fp32 scales, and
every unquantized parameter as it is served (--serve_dtype, bf16 by default, the dtype the decode step reads;
fp32 is what training keeps). Per chip is the total over --chips, i.e. the weights spread evenly (what
expert and tensor parallelism aim at); the KV cache and activations come on top.
"""

import json

import jax
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from glm_jax import cli
from glm_jax.model import GlmMoeDsa, ModelConfig
from glm_jax.model.quantization import default_quant_config, pack_params, quant_plan, weight_bytes

_CONFIG = config_flags.DEFINE_config_file("config", "configs/glm5_744b.py", "A configs/*.py file.")
_CHIPS = flags.DEFINE_list("chips", ["64", "256", "512"], "Chip counts to spread the weights over.")
_SERVE_DTYPE = flags.DEFINE_string("serve_dtype", "bfloat16", "The dtype of the unquantized parameters served.")
_GROUP = flags.DEFINE_integer("group_size", 128, "int4's group size (GLM-5 / slime: 128).")

SCHEMES = [
  ("bf16", "none", ""),
  ("int4 experts (GLM-5 QAT)", "int4", ""),
  ("int4 all linear, groups", "int4", "routed_experts,shared_experts,dense_mlp,attention"),
  ("int4_row (GLM-130B)", "int4_row", ""),
  ("w8a8", "w8a8", ""),
  ("w4a8 (Ascend mix)", "w4a8", ""),
]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cfg = ModelConfig.from_dict(_CONFIG.value.model).replace(param_dtype=_SERVE_DTYPE.value)
  params = nnx.state(nnx.eval_shape(lambda: GlmMoeDsa(cfg, nnx.Rngs(0))), nnx.Param)
  chips = [int(c) for c in _CHIPS.value]
  for name, scheme, scope in SCHEMES:
    q = default_quant_config()
    q.scheme, q.group_size, q.scope = scheme, _GROUP.value, scope
    packed = params if scheme == "none" else jax.eval_shape(lambda p, q=q: pack_params(p, quant_plan(p, q)), params)
    total = weight_bytes(packed)
    print(
      json.dumps(
        {
          "scheme": name,
          "total_GiB": round(total / 2**30, 1),
          **{f"per_chip_GiB_{c}": round(total / c / 2**30, 2) for c in chips},
        }
      ),
      flush=True,
    )


if __name__ == "__main__":
  cli.run(main)
