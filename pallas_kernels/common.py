"""What the DSA kernels share: padding arithmetic, the VMEM budget a kernel asks Mosaic for, and where it runs.

Nothing here is a kernel; each kernel file holds its kernel and custom_vjp only (and imports this).
"""

import jax

MiB = 1 << 20
_VMEM_SLACK_BYTES = 16 * MiB  # on top of a kernel's own estimate of its blocks and scratch
_VMEM_CAP_BYTES = 64 * MiB  # the most a kernel asks for: half of a v5p / v6e TensorCore's 128 MiB


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def vmem_limit(needed_bytes: int) -> int:
  """Mosaic's vmem_limit_bytes for a kernel whose blocks and scratch take about `needed_bytes`."""
  return int(min(needed_bytes + _VMEM_SLACK_BYTES, _VMEM_CAP_BYTES))


def resolve_interpret(interpret):
  """A kernel's `interpret` argument: None = compiled on TPU, Pallas interpret mode on any other backend."""
  return jax.default_backend() != "tpu" if interpret is None else interpret


def check_block_sizes(fn: str, block_sizes, cls: type) -> None:
  """TypeError unless block_sizes is None or a `cls` (the kernel's block-size dataclass)."""
  if block_sizes is not None and not isinstance(block_sizes, cls):
    article = "an" if cls.__name__[0] in "AEIOU" else "a"
    raise TypeError(f"{fn}: block_sizes={block_sizes!r}; want {article} {cls.__name__} or None")


def check_ranks(fn: str, **operands) -> None:
  """ValueError naming every operand's layout and shape unless each has its layout's rank.
  operands: name=(array, "[B, T, H, D]")."""
  if any(x.ndim != layout.count(",") + 1 for x, layout in operands.values()):
    want = ", ".join(f"{name} {layout}" for name, (_, layout) in operands.items())
    got = ", ".join(str(x.shape) for x, _ in operands.values())
    raise ValueError(f"{fn}: want {want}; got shapes {got}")
