"""The engine's command-line flags, defined once: launch/serve.py and launch/compile.py --serve each call `define`
with their own defaults, one flag a field of EngineConfig (--pages for num_pages, every other flag the field's name).

  engine_config = engine_flags.define(EngineConfig(num_pages=256))   # at import, beside the program's other flags
  ...
  config = engine_config()                                          # in main: the EngineConfig the flags give
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from absl import flags

from glm_jax.serving.engine import EngineConfig

FLAG_NAMES = {"num_pages": "pages"}  # a field's flag where it is not the field's name
HELP = {
  "num_pages": "Pages in the cache's pool (page 0 is scratch; under a mesh, one a batch shard).",
  "page_size": "Tokens a page.",
  "max_running": "Requests decoded together (the decode program's rows).",
  "prefill_chunk": "Prompt tokens a prefilling request feeds a prefill step.",
  "prefill_rows": "Requests prefilled together (the prefill step's rows; at most --max_running).",
  "speculate": "MTP speculative decoding: tokens drafted a round (0: none).",
  "max_seq_len": "A request's prompt + new tokens at most (the page table's width).",
  "decode_steps": "Decode steps a call of the decode program (a host round trip for that many tokens a request).",
}


def define(defaults: EngineConfig, *, help_prefix: str = "") -> Callable[[], EngineConfig]:
  """Defines a flag for each EngineConfig field, with `defaults`' values, and returns the function that reads them
  into an EngineConfig. A flag the program has already defined under that name (launch/compile.py's --speculate,
  which its --decode reads too) is read as it is."""
  names = {}
  for field in dataclasses.fields(EngineConfig):
    name = FLAG_NAMES.get(field.name, field.name)
    if name not in flags.FLAGS:
      flags.DEFINE_integer(name, getattr(defaults, field.name), help_prefix + HELP[field.name])
    names[field.name] = name
  return lambda: EngineConfig(**{field: flags.FLAGS[name].value for field, name in names.items()})
