"""One spelling for the path of a leaf in a pytree of parameters, used wherever a parameter is named: the
optimizer's per-parameter plan, sharding specs, checkpoints and error messages.

  path_names(path)  a jax key path as plain keys: ("moe_layers", "self_attn", "kv_b_proj"). The `.value` step
                    into an nnx.Variable is dropped, so an nnx.State of Params and its pure-dict form (and
                    nnx.to_flat_state's paths) give the same names.
  path_str(names)   "moe_layers/self_attn/kv_b_proj", for messages.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

Names = tuple[Any, ...]


def path_names(path: Iterable[Any]) -> Names:
  out = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      out.append(k.key)
    elif isinstance(k, jax.tree_util.SequenceKey):
      out.append(k.idx)
    elif isinstance(k, jax.tree_util.GetAttrKey):
      if k.name != "value":
        out.append(k.name)
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      out.append(k.key)
    else:  # already a plain key (nnx.to_flat_state's paths)
      out.append(k if isinstance(k, (str, int)) else str(k))
  return tuple(out)


def path_str(names: Iterable[Any]) -> str:
  return "/".join(map(str, names))
