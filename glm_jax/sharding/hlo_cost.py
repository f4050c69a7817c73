"""The cost of a compiled XLA program op by op, read from its optimized HLO text, and its time on a TPU slice.

Each instruction the program runs (a fusion, a Pallas kernel, a collective, a copy, ...) becomes one `Op`, counted
as many times as it runs (a while loop's body times its trip count):
  flops    matmul FLOPs of the dots and convolutions it holds; a Pallas kernel's `cost_estimate` as declared, unless
           a kernel model passed to `program_ops` replaces it (grouped_matmul.megablox_grid_cost: the tiles its grid
           visits for a stated routing)
  bytes    HBM traffic: its operands and results, only the slice where a dynamic-slice reads or a
           dynamic-update-slice writes in place
  compute_seconds   XLA:TPU's own estimate (`estimated_cycles` at CLOCK_HZ) where it gives one; else the roofline
           over the efficiency of its class (EFFICIENCY, experiments/xla_op_efficiency.py)
  wire, wire_seconds   for a collective (counted once per logical transfer), the bytes one chip sends or receives
           (a ragged all-to-all's real rows only) and their time on the slice's torus (glm_jax/sharding/ici.py)
An unknown replica-group syntax is an error naming the op. `summarize` and `schedule` give two step times: serial
(every op one after another) and scheduled (the program's own order on one compute stream, one interconnect queue
and, for multislice, one DCN queue). Peaks per TPU generation: PEAKS. Why not XLA's cost_analysis, and each rule in
full: docs/pods.md, "How the pod figures are counted".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable

import numpy as np

from glm_jax.sharding import ici


@dataclasses.dataclass(frozen=True)
class Peaks:
  bf16_flops: float  # FLOP/s a chip, dense bf16
  hbm_bytes_per_s: float  # HBM bandwidth a chip
  ici_bytes_per_s: float  # inter-chip interconnect bandwidth a chip, all links one way (ici.LINKS has them a link)
  source: str


# Google Cloud's published per-chip figures (cloud.google.com/tpu/docs/<generation>): peak bf16 compute, HBM
# bandwidth, ICI bandwidth (published in Gbps; / 8 here).
PEAKS: dict[str, Peaks] = {
  "v4": Peaks(275e12, 1228e9, 2400e9 / 8, "cloud.google.com/tpu/docs/v4"),
  "v5e": Peaks(197e12, 819e9, 1600e9 / 8, "cloud.google.com/tpu/docs/v5e"),
  "v5p": Peaks(459e12, 2765e9, 4800e9 / 8, "cloud.google.com/tpu/docs/v5p"),
  "v6e": Peaks(918e12, 1640e9, 3584e9 / 8, "cloud.google.com/tpu/docs/v6e"),
}

# The TensorCore clock at which XLA:TPU's `estimated_cycles` become seconds: the published bf16 peak over the MXUs'
# FLOPs a cycle (TensorCores a chip x MXUs a TensorCore x 128 x 128 x 2; cloud.google.com/tpu/docs/<generation>
# gives 2 x 4 for v4 and v5p, 1 x 4 for v5e): v5p 1.75 GHz. v6e's page gives two different MXU counts, so its
# clock is not derived and its ops use the efficiency table.
CLOCK_HZ: dict[str, float] = {
  "v4": 275e12 / (2 * 4 * 128 * 128 * 2),
  "v5e": 197e12 / (1 * 4 * 128 * 128 * 2),
  "v5p": 459e12 / (2 * 4 * 128 * 128 * 2),
}
UNKNOWN_CYCLES = (1 << 63) - 1  # XLA's "no estimate"

# The model against a measured run (experiments/calibrate_maxtext.py; docs/pods.md, "How the pod figures are
# counted"): a pod figure's calibrated step is its scheduled estimate times realism_factor. The run: MaxText's
# DeepSeek-V3 671B recipe on v5p-1024 (AI-Hypercomputer/tpu-recipes, training/v5p/DeepSeek3-671B-MaxText: 6 x 8192
# tokens a chip), compiled with MaxText 0.2.5 at 5 sequences a chip (6 do not fit at compile time), its measured time
# scaled by 5/6; its grouped matmuls are costed by their grids as ours are (its kernels carry no op names:
# kernel_model knows them by instruction name).
CALIBRATION: dict | None = {
  "realism_factor": 1.112,
  "measured_seconds": 75.583,
  "model_scheduled_seconds": 67.968,
  "model_serial_seconds": 77.67,
  "source": "experiments/calibrate_maxtext.py on MaxText 0.2.5's DeepSeek-V3 671B v5p-1024 recipe (batch 5 of 6), "
  "its grouped matmuls costed by their grids as ours are",
}

# Roofline time / XLA:TPU's estimate, for ops XLA gives no estimate of (Pallas kernels, fusions with the sentinel):
# the means experiments/xla_op_efficiency.py printed on v5p (libtpu 0.0.42.1) over 16 bf16 matmuls of 2048 to 16384
# rows, K 2048 and 7168, N 2048 and 6144 ("matmul", bound by the MXU: 0.875 to 0.978), and f32 elementwise ops of
# 16 to 256 MiB ("hbm", bound by HBM: 0.657 to 0.718).
EFFICIENCY: dict[str, float] = {"matmul": 0.939, "hbm": 0.694}

_DTYPE_BYTES = {
  "pred": 1,
  "s4": 0.5,
  "u4": 0.5,
  "s8": 1,
  "u8": 1,
  "f8e4m3fn": 1,
  "f8e5m2": 1,
  "bf16": 2,
  "f16": 2,
  "s16": 2,
  "u16": 2,
  "f32": 4,
  "s32": 4,
  "u32": 4,
  "f64": 8,
  "s64": 8,
  "u64": 8,
  "c64": 8,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%(\S+)\s+=\s+(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%(\S+)\s.*\{\s*$")
_NO_TRAFFIC = {
  "parameter",
  "constant",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "after-all",
  "partition-id",
  "replica-id",
  "opt-barrier",
  "while",
  "call",
  "conditional",
  "add-dependency",
}
# the collectives the link model times (ici.COLLECTIVE_KINDS), synchronous or as the start of an async pair
COLLECTIVES = set(ici.COLLECTIVE_KINDS) | {f"{kind}-start" for kind in ici.COLLECTIVE_KINDS}


@dataclasses.dataclass
class Op:
  name: str
  opcode: str  # fusion, custom-call, all-gather-start, copy-start, ...
  kind: str  # what it is for the tables: "matmul fusion", "fusion", "pallas <kernel>", a collective, ...
  op_name: str  # jax's name for the source op (metadata op_name)
  flops: float
  bytes: float
  wire: float = 0.0  # bytes over ICI (collectives), counted once a logical collective
  note: str = ""
  compute_seconds: float = 0.0  # all runs; see the module docstring
  wire_seconds: float = 0.0  # all runs
  runs: int = 1  # how many times it runs in one run of the program
  computation: str = ""  # the computation it sits in
  collective: str = ""  # the logical collective it takes part in ("" for none)
  role: str = ""  # in that collective: "sync", "start", "continue" or "done"
  timing: str = ""  # "xla estimate" or "roofline / efficiency"
  costed: bool = False  # compute_seconds and wire_seconds were set (program_ops with a chip)


def array_shapes(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, dims) of every array in an HLO type (one array or a tuple), layouts ignored."""
  return [
    (dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(type_text) if dt in _DTYPE_BYTES
  ]


def nbytes(shapes) -> float:
  return sum(_DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in shapes)


@dataclasses.dataclass
class _Instr:
  name: str
  opcode: str
  shapes: list
  operands: list[str]
  attrs: str
  line: str


def _split_operands(rest: str) -> tuple[list[str], str]:
  """The operand names of `rest` (the text after `opcode(`) and the attributes after the closing parenthesis."""
  depth, i = 1, 0
  while i < len(rest) and depth:
    depth += {"(": 1, ")": -1}.get(rest[i], 0)
    i += 1
  return re.findall(r"%([\w.\-]+)", rest[: i - 1]), rest[i:]


@functools.lru_cache(maxsize=1)
def parse_module(text: str) -> tuple[dict[str, list[_Instr]], str, dict[str, _Instr]]:
  """(computations by name, the entry's name, every instruction by name). The last text's is kept (a cost report
  reads each program several times in a row: its ops, then its schedule; one kept, as a 744B program's parse is
  large); callers do not modify it."""
  comps: dict[str, list[_Instr]] = {}
  entry, current, by_name = "", None, {}
  for line in text.splitlines():
    m = _COMPUTATION.match(line)
    if m and "=" not in line.split("{")[0].split("->")[0].split("(")[0]:
      current = comps.setdefault(m.group(2), [])
      if m.group(1):
        entry = m.group(2)
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if m and current is not None:
      operands, attrs = _split_operands(m.group(5))
      ins = _Instr(m.group(2), m.group(4), array_shapes(m.group(3)), operands, attrs, line)
      current.append(ins)
      by_name[ins.name] = ins
  return comps, entry, by_name


def _attr(attrs: str, key: str) -> str | None:
  m = re.search(rf"\b{key}=(%?[\w.\-]+|\{{[^}}]*\}})", attrs)
  return m.group(1) if m else None


def matmul_flops(ins: _Instr, by_name: dict[str, _Instr]) -> float:
  """FLOPs of a dot or convolution instruction (0 for any other)."""
  out = math.prod(ins.shapes[0][1]) if ins.shapes else 0
  if ins.opcode == "dot":
    lhs = by_name[ins.operands[0]].shapes[0][1]
    dims = _attr(ins.attrs, "lhs_contracting_dims") or "{}"
    contracted = math.prod(lhs[int(d)] for d in re.findall(r"\d+", dims))
    return 2.0 * out * contracted
  if ins.opcode == "convolution":
    rhs = by_name[ins.operands[1]].shapes[0][1]
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if not labels:
      return 2.0 * out * math.prod(rhs)
    features = rhs[labels.group(2).index("i")]
    return 2.0 * out * features * _real_taps(ins, by_name, labels.groups())
  return 0.0


def _window_field(window: str, key: str, n: int, default: int) -> list[int]:
  m = re.search(rf"\b{key}=([\d_x\-]+)", window)
  if not m:
    return [default] * n
  return [int(v.split("_")[0]) for v in m.group(1).split("x")]


def _real_taps(ins: _Instr, by_name: dict[str, _Instr], labels: tuple[str, str, str]) -> float:
  """The window taps an output element of a convolution sums that land on real input, averaged over the output:
  XLA:TPU writes batched and outer-product dots as convolutions whose windows mostly cover padding or
  lhs-dilation holes (a batch axis as a window with lhs_dilate equal to it: one real tap of the window)."""
  lhs_labels, _, out_labels = labels
  lhs, out = by_name[ins.operands[0]].shapes[0][1], ins.shapes[0][1]
  spatial = sorted(c for c in lhs_labels if c.isdigit())
  window = (re.search(r"window=\{([^}]*)\}", ins.attrs) or [None, ""])[1]
  n = len(spatial)
  size, stride = _window_field(window, "size", n, 1), _window_field(window, "stride", n, 1)
  pad, dilate = _window_field(window, "pad", n, 0), _window_field(window, "lhs_dilate", n, 1)
  rhs_dilate = _window_field(window, "rhs_dilate", n, 1)
  taps = 1.0
  for j, c in enumerate(spatial):
    real, o_size = lhs[lhs_labels.index(c)], out[out_labels.index(c)]
    if o_size * size[j] > 10**7:  # a real image convolution: every tap inside the (undilated) input
      taps *= size[j] / dilate[j]
      continue
    on_input = {pad[j] + k * dilate[j] for k in range(real)}
    hits = sum(o * stride[j] + t * rhs_dilate[j] in on_input for o in range(o_size) for t in range(size[j]))
    taps *= hits / o_size
  return taps


def _fused_flops(comp: str, comps, by_name) -> float:
  total = 0.0
  for ins in comps.get(comp, ()):
    total += matmul_flops(ins, by_name)
    called = _attr(ins.attrs, "calls")
    if ins.opcode == "fusion" and called:
      total += _fused_flops(called.lstrip("%"), comps, by_name)
  return total


def num_partitions(text: str) -> int:
  """The partitions (devices) the module runs on, from its header (1 when it does not say)."""
  m = re.search(r"\bnum_partitions=(\d+)", text.split("\n", 1)[0])
  return int(m.group(1)) if m else 1


_IOTA_LIST = re.compile(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?")  # [dims](<=[reshape])?T(perm)
_AXIS_REF = re.compile(r"'([^']*)'(?::\((\d+)\)(\d+))?")


def _iota(reshape: str, perm: str | None) -> np.ndarray:
  dims = [int(d) for d in reshape.split(",")]
  arr = np.arange(math.prod(dims)).reshape(dims)
  return arr.transpose([int(p) for p in perm.split(",")]) if perm else arr


def _balanced(text: str) -> str:
  """The brace-balanced prefix of text (which starts with "{")."""
  depth = 0
  for i, ch in enumerate(text):
    depth += {"{": 1, "}": -1}.get(ch, 0)
    if depth == 0:
      return text[: i + 1]
  raise ValueError(f"unbalanced braces in {text[:80]!r}")


def _mesh_groups(text: str, where: str) -> list[list[int]]:
  """Groups of the `mesh['a'=4,'b'=2](, device_ids=(...))? {'a','b':(1)2}` form: the devices laid out as the mesh
  (row-major, or as device_ids lists them), and a group for every position of the axes not named, over the named
  ones (a sub-axis 'b':(pre)size is the middle part of b reshaped to [pre, size, rest])."""
  m = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}", text)
  if not m:
    raise ValueError(f"{where}: replica_groups={text[:120]!r} is not a mesh form the cost model reads")
  axes = [(name, int(size)) for name, size in re.findall(r"'([^']*)'=(\d+)", m.group(1))]
  total = math.prod(size for _, size in axes)
  if m.group(2):
    listed = _IOTA_LIST.fullmatch(m.group(2).strip())
    devices = (
      _iota(listed.group(2) or listed.group(1), listed.group(3)).reshape(-1)
      if listed
      else np.array([int(d) for d in m.group(2).split(",")])
    )
  else:
    devices = np.arange(total)
  if devices.size != total:
    raise ValueError(f"{where}: mesh of {total} devices lists {devices.size}")
  refs = [
    (name, int(pre) if pre else None, int(size) if size else None) for name, pre, size in _AXIS_REF.findall(m.group(3))
  ]
  known = {name for name, _ in axes}
  if any(name not in known for name, _, _ in refs):
    raise ValueError(f"{where}: replica group axes {[r[0] for r in refs]} are not all mesh axes {sorted(known)}")
  factors, position = [], {}
  for name, n in axes:
    mine = sorted((r for r in enumerate(refs) if r[1][0] == name), key=lambda r: r[1][1] or 0)
    if not mine:
      factors.append(n)
      continue
    if any(pre is None for _, (_, pre, _) in mine):  # the whole axis
      position[mine[0][0]] = len(factors)
      factors.append(n)
      continue
    prefix = 1
    for i, (_, pre, size) in mine:
      if pre != prefix:
        factors.append(pre // prefix)
        prefix = pre
      position[i] = len(factors)
      factors.append(size)
      prefix *= size
    if prefix != n:
      factors.append(n // prefix)
  if math.prod(factors) != total:
    raise ValueError(f"{where}: sub-axes of replica groups {m.group(3)!r} do not divide mesh {m.group(1)!r}")
  grouped = [position[i] for i in range(len(refs))]
  others = [a for a in range(len(factors)) if a not in grouped]
  size = math.prod(factors[a] for a in grouped)
  return devices.reshape(factors).transpose(others + grouped).reshape(-1, size).tolist()


def replica_groups(ins: _Instr, partitions: int) -> list[list[int]]:
  """The partition ids of every replica group of a collective, from any syntax XLA prints: explicit
  `{{0,1},{2,3}}` (`{}`: one group of all), iota `[g,s]<=[dims]T(perm)`, or `mesh[...] {axes}`; no
  replica_groups attribute is one group of all. ValueError, naming the op, for any other."""
  where = f"{ins.opcode} %{ins.name}"
  m = re.search(r"\breplica_groups=", ins.attrs)
  if not m:
    return [list(range(partitions))]
  text = ins.attrs[m.end() :]
  if text.startswith("{"):
    body = _balanced(text)
    groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", body[1:-1])]
    return groups or [list(range(partitions))]
  if text.startswith("["):
    iota = _IOTA_LIST.match(text)
    dims = [int(d) for d in iota.group(1).split(",")] if iota else []
    if len(dims) != 2 or not iota.group(2):
      raise ValueError(f"{where}: replica_groups={text[:120]!r} is not an iota form the cost model reads")
    return _iota(iota.group(2), iota.group(3)).reshape(dims).tolist()
  if text.startswith("mesh["):
    return _mesh_groups(text, where)
  raise ValueError(f"{where}: replica_groups={text[:120]!r} is a syntax the cost model does not read")


def source_target_pairs(ins: _Instr) -> list[tuple[int, int]]:
  m = re.search(r"\bsource_target_pairs=(\{.*)", ins.attrs)
  if not m:
    raise ValueError(f"{ins.opcode} %{ins.name} has no source_target_pairs")
  return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", _balanced(m.group(1)))]


def called_computations(ins: _Instr) -> list[str]:
  """The computations an instruction runs: a fusion's, a while's body and condition, a call's, a conditional's
  branches (not a reduction's reducer, which is not a computation that runs on its own)."""
  if ins.opcode == "while":
    names = [_attr(ins.attrs, "body"), _attr(ins.attrs, "condition")]
  elif ins.opcode in ("call", "fusion"):
    names = [_attr(ins.attrs, "to_apply" if ins.opcode == "call" else "calls")]
  elif ins.opcode == "conditional":
    names = re.findall(r"%([\w.\-]+)", _attr(ins.attrs, "branch_computations") or "")
    names += [_attr(ins.attrs, "true_computation"), _attr(ins.attrs, "false_computation")]
  else:
    names = []
  return [n.lstrip("%") for n in names if n]


def _scalar_constant(name: str, by_name: dict[str, _Instr]) -> int | None:
  """The integer value of a scalar constant, through copies; None for anything else."""
  ins = by_name.get(name)
  while ins is not None and ins.opcode == "copy" and ins.operands:
    ins = by_name.get(ins.operands[0])
  if ins is None or ins.opcode != "constant":
    return None
  m = re.search(r"\bconstant\((-?\d+)\)", ins.line)
  return int(m.group(1)) if m else None


def _root(comp: list[_Instr]) -> _Instr | None:
  return next((i for i in comp if i.line.lstrip().startswith("ROOT")), None)


def trip_count(ins: _Instr, comps: dict[str, list[_Instr]], by_name: dict[str, _Instr]) -> int | None:
  """A while loop's iteration count: XLA's known_trip_count when its backend config has one (XLA:CPU's), else
  read from the loop as jax's scan and fori_loop write it (XLA:TPU's optimized HLO drops the field): the condition
  is `counter < limit` on a tuple element that starts at a constant and to which the body adds a constant step.
  None for any other loop."""
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
  if m:
    return int(m.group(1))
  cond = _root(comps.get((_attr(ins.attrs, "condition") or "").lstrip("%"), []))
  body = _root(comps.get((_attr(ins.attrs, "body") or "").lstrip("%"), []))
  init = by_name.get(ins.operands[0]) if ins.operands else None
  if (
    cond is None
    or body is None
    or init is None
    or cond.opcode != "compare"
    or "direction=LT" not in cond.attrs
    or len(cond.operands) != 2
    or body.opcode != "tuple"
    or init.opcode != "tuple"
  ):
    return None
  counter, limit = by_name.get(cond.operands[0]), _scalar_constant(cond.operands[1], by_name)
  if counter is None or counter.opcode != "get-tuple-element" or limit is None:
    return None
  k = int(_attr(counter.attrs, "index") or -1)
  if not 0 <= k < min(len(init.operands), len(body.operands)):
    return None
  start, update = _scalar_constant(init.operands[k], by_name), by_name.get(body.operands[k])
  if start is None or update is None or update.opcode != "add":
    return None
  steps = [_scalar_constant(o, by_name) for o in update.operands]
  step = next((v for v in steps if v is not None), None)
  if step is None or step <= 0:
    return None
  return max(0, -(-(limit - start) // step))


KernelModel = Callable[[str, _Instr, dict], "tuple[float, float, str] | None"]
RaggedModel = Callable[[_Instr], "float | None"]
BranchModel = Callable[[list[str]], "int | None"]  # each branch's op names, joined -> the branch that runs (or None)


def _executed(comps, entry, by_name, branch_model: BranchModel | None = None) -> dict[str, int]:
  """{computation: how many times it runs in one run of the program} for the computations that run as control
  flow (the entry, while bodies and conditions, called computations, conditional branches), not fused or reducer
  computations. A while loop's body runs its known trip count times its caller's count (once when XLA does not
  know the count). A conditional's branches each run once, or only the one branch_model picks."""
  times, order = {entry: 1}, [entry]
  for comp in order:
    for ins in comps.get(comp, ()):
      if ins.opcode != "fusion":
        k = (trip_count(ins, comps, by_name) or 1) if ins.opcode == "while" else 1
        called = called_computations(ins)
        if ins.opcode == "conditional" and branch_model is not None:
          pick = branch_model([" ".join(op_name(i) for i in comps.get(c, ())) for c in called])
          called = called if pick is None else [called[pick]]
        for n in called:
          if n not in times:
            times[n] = times[comp] * k
            order.append(n)
  return times


def op_name(ins: _Instr) -> str:
  """jax's name for the instruction's source op (its metadata op_name), or ""."""
  m = re.search(r'op_name="([^"]*)"', ins.attrs)
  return m.group(1) if m else ""


_PASS_THROUGH = {"bitcast", "reshape", "copy", "convert"}  # a slice read through these is still a slice


def _params(comp: list[_Instr]) -> dict[int, str]:
  """{parameter number: its instruction's name} of a computation."""
  return {
    int(m.group(1)): i.name for i in comp if i.opcode == "parameter" and (m := re.search(r"parameter\((\d+)\)", i.line))
  }


def _slice_reads(name: str, comp: list[_Instr], comps: dict[str, list[_Instr]]) -> float | None:
  """The bytes instruction `name` of a computation has read from it when every use (through bitcasts and the like,
  and into nested fusions) is a dynamic-slice of it, or is the buffer operand of a dynamic-update-slice (an
  in-place update: the update's bytes); None when some use reads it whole, or it leaves the computation (its root)."""
  root = _root(comp)
  if root is None or root.name == name or not any(name in i.operands for i in comp):
    return None
  total = 0.0
  for use in comp:
    if name not in use.operands:
      continue
    if use.opcode == "dynamic-slice" and use.operands[0] == name:
      total += nbytes(use.shapes)
    elif use.opcode == "dynamic-update-slice" and use.operands[0] == name and use.operands.count(name) == 1:
      total += _update_bytes(use, comp)
    elif use.opcode in _PASS_THROUGH or use.opcode == "fusion":
      if use.opcode == "fusion":
        nested = comps.get((_attr(use.attrs, "calls") or "").lstrip("%"), [])
        params = _params(nested)
        inner = [
          _slice_reads(params[j], nested, comps) if j in params else None
          for j, o in enumerate(use.operands)
          if o == name
        ]
      else:
        inner = [_slice_reads(use.name, comp, comps)]
      if any(x is None for x in inner):
        return None
      total += sum(inner)
    else:
      return None
  return total


def _update_bytes(dus: _Instr, comp: list[_Instr]) -> float:
  by = {i.name: i for i in comp}
  update = by.get(dus.operands[1])
  return nbytes(update.shapes) if update is not None else nbytes(dus.shapes)


def _moved_bytes(ins: _Instr, comps: dict[str, list[_Instr]], by_name: dict[str, _Instr]) -> float:
  """HBM bytes an instruction moves: its operands and results, with a dynamic-slice's operand counted as the slice
  and a dynamic-update-slice's buffer as the update (read and written), at top level or inside a fusion."""
  operands = [nbytes(by_name[o].shapes) if o in by_name else 0.0 for o in ins.operands]
  result = nbytes(ins.shapes)
  if ins.opcode == "dynamic-slice" and operands:
    operands[0] = result
  elif ins.opcode == "dynamic-update-slice" and len(operands) > 1:
    operands[0], result = operands[1], operands[1]
  elif ins.opcode == "fusion":
    comp = comps.get((_attr(ins.attrs, "calls") or "").lstrip("%"), [])
    for k, name in _params(comp).items():
      sliced = _slice_reads(name, comp, comps) if k < len(operands) else None
      if sliced is not None:
        operands[k] = min(operands[k], sliced)
    root = _root(comp)
    outs = (
      [root]
      if root is not None and root.opcode != "tuple"
      else [next((i for i in comp if i.name == o), None) for o in (root.operands if root is not None else [])]
    )
    if outs and all(o is not None and o.opcode == "dynamic-update-slice" for o in outs):
      result = sum(_update_bytes(o, comp) for o in outs)  # written in place: only the updates move
  return sum(operands) + result


@dataclasses.dataclass(frozen=True)
class Chip:
  """What the per-op times need of a chip: its peaks, XLA's clock (None: no XLA estimates used) and, for a program
  with collectives, where its partitions sit (None: a collective's time is its wire bytes over all of a chip's
  links, the model with no topology)."""

  peaks: Peaks
  clock_hz: float | None = None
  torus: ici.Torus | None = None

  @classmethod
  def of(cls, generation: str, torus: ici.Torus | None = None) -> Chip:
    if generation not in PEAKS:
      raise ValueError(f"TPU generation {generation!r} has no peaks in hlo_cost.PEAKS ({sorted(PEAKS)})")
    return cls(PEAKS[generation], CLOCK_HZ.get(generation), torus)


def _estimated_cycles(ins: _Instr) -> int | None:
  m = re.search(r'"estimated_cycles":"(\d+)"', ins.attrs)
  return int(m.group(1)) if m and int(m.group(1)) != UNKNOWN_CYCLES else None


def roofline_seconds(flops: float, moved: float, peaks: Peaks) -> float:
  """An op's time at the efficiency of its bound (EFFICIENCY)."""
  return max(flops / peaks.bf16_flops / EFFICIENCY["matmul"], moved / peaks.hbm_bytes_per_s / EFFICIENCY["hbm"])


def _channel(ins: _Instr) -> str | None:
  m = re.search(r"\bchannel_id=(\d+)", ins.attrs)
  return m.group(1) if m else None


def _called_list(ins: _Instr) -> list[str]:
  """The computations of a `called_computations={%a, %b}` attribute."""
  m = re.search(r"\bcalled_computations=\{([^}]*)\}", ins.attrs)
  return [n.strip().lstrip("%") for n in m.group(1).split(",")] if m else []


def _inner_collectives(comp: str, comps, seen=None) -> list[tuple[_Instr, list[_Instr]]]:
  """The collective instructions inside a fused computation (and its nested fusions), each with its computation."""
  seen = seen if seen is not None else set()
  if comp in seen:
    return []
  seen.add(comp)
  found = []
  for ins in comps.get(comp, ()):
    if ins.opcode in COLLECTIVES:
      found.append((ins, comps[comp]))
    elif ins.opcode == "fusion":
      found += _inner_collectives((_attr(ins.attrs, "calls") or "").lstrip("%"), comps, seen)
  return found


def _collective_kind(ins: _Instr, comp: list[_Instr]) -> str:
  """The collective's kind; an all-reduce whose result is only dynamic-sliced (XLA:TPU's all-reduce-scatter
  fusion) is a reduce-scatter."""
  kind = ins.opcode.removesuffix("-start")
  if kind == "all-reduce":
    uses = [u for u in comp if ins.name in u.operands]
    if uses and all(u.opcode == "dynamic-slice" and u.operands[0] == ins.name for u in uses):
      return "reduce-scatter"
  return kind


def ragged_buffer(ins: _Instr) -> tuple[int, ...]:
  """A ragged all-to-all's output buffer's dimensions: its result, or the largest array of an async start's tuple
  (which also holds the operand, the offsets and the sizes)."""
  return max(ins.shapes, key=lambda s: nbytes([s]))[1] if ins.shapes else ()


def _collective_bytes(ins: _Instr, kind: str, by_name: dict[str, _Instr]) -> float:
  """The bytes ici.collective_seconds takes: the gathered result, or the operand (the largest array of an async
  start's tuple)."""
  results = max((nbytes([s]) for s in ins.shapes), default=0.0)
  operands = sum(nbytes(by_name[o].shapes) for o in ins.operands if o in by_name)
  if kind in ("reduce-scatter", "all-reduce"):
    return operands or results
  return results


def program_ops(
  text: str,
  *,
  kernel_model: KernelModel | None = None,
  ragged_rows: RaggedModel | None = None,
  chip: Chip | None = None,
  branch_model: BranchModel | None = None,
) -> list[Op]:
  """Every op the compiled program's HLO text runs, with its FLOPs, HBM bytes and wire bytes, and with `chip` its
  compute and wire seconds (the module docstring).

  kernel_model(op_name, instruction, instructions by name) -> (flops, bytes, note) or None: the cost of a Pallas
  kernel as its grid runs (None: keep the kernel's declared cost_estimate).
  ragged_rows(instruction) -> the real rows a ragged all-to-all moves, counted in entries of its result's leading
  dimension (a block of rows when the buffer is [blocks, rows a block, ...]; None: its whole result).
  branch_model(op names of each branch) -> the branch of a conditional that runs (None, or no model: every branch
  is counted once, and the schedule takes the longest)."""
  comps, entry, by_name = parse_module(text)
  partitions = num_partitions(text)
  if chip is not None and chip.torus is not None and chip.torus.num_partitions != partitions:
    raise ValueError(f"the program runs on {partitions} partitions, the torus places {chip.torus.num_partitions}")
  ops = []
  for comp, times in _executed(comps, entry, by_name, branch_model).items():
    seen_channels: dict[str, list[Op]] = {}
    for ins in comps[comp]:
      if ins.opcode in _NO_TRAFFIC:
        continue
      source = op_name(ins)
      if ins.opcode.endswith("-done"):  # ends the async op its operand started; costs nothing of its own
        start = ins.operands[0] if ins.operands else ""
        ops.append(
          Op(
            ins.name,
            ins.opcode,
            ins.opcode.removesuffix("-done"),
            source,
            0.0,
            0.0,
            runs=times,
            computation=comp,
            collective=start,
            role="done",
            costed=chip is not None,
          )
        )
        continue
      moved = _moved_bytes(ins, comps, by_name)
      flops, note, kind = matmul_flops(ins, by_name), "", ins.opcode
      collectives: list[tuple[_Instr, list[_Instr]]] = []
      if ins.opcode == "fusion":
        called = (_attr(ins.attrs, "calls") or "").lstrip("%")
        flops = _fused_flops(called, comps, by_name)
        kind = "matmul fusion" if flops else "fusion"
        collectives = _inner_collectives(called, comps)
      elif ins.opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in ins.attrs:
        kernel = re.search(r"jit\((\w+)\)/pallas_call", source)  # megablox: jit(gmm); else the instruction's name
        kind = "pallas " + (kernel.group(1) if kernel else re.sub(r"[.]\d+$", "", ins.name))
        declared = re.search(
          r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"\d+","bytes_accessed":"(\d+)"', ins.attrs
        )
        flops, moved = (float(declared.group(1)), float(declared.group(2))) if declared else (0.0, moved)
        note = "declared cost_estimate" if declared else "no cost_estimate"
        modeled = kernel_model(source, ins, by_name) if kernel_model else None
        if modeled is not None:
          flops, moved, note = modeled
      elif ins.opcode == "custom-call-start":  # an async op on another core (SparseCore): a collective it runs
        collectives = [c for name in _called_list(ins) for c in _inner_collectives(name, comps)]
        moved = 0.0
      elif ins.opcode.endswith("-start") and ins.opcode not in COLLECTIVES:  # copy-start: (dst, src, context)
        moved = 2 * max((nbytes([s]) for s in ins.shapes), default=0.0)
      elif ins.opcode == "custom-call-update" and ins.operands:  # feeds the async op its operands
        start = next((o for o in reversed(ops) if o.name == ins.operands[0] and o.computation == comp), None)
        ops.append(
          Op(
            ins.name,
            ins.opcode,
            start.kind if start else "custom-call",
            source,
            0.0,
            0.0,
            runs=times,
            computation=comp,
            collective=start.collective if start else "",
            costed=chip is not None,
          )
        )
        continue
      elif ins.opcode in ("send", "recv") and "_xla_megascale_transfer_type" in ins.attrs:
        ops.append(_dcn_op(ins, comp, times, source, seen_channels, by_name, chip))
        continue
      elif ins.opcode in COLLECTIVES:
        collectives = [(ins, comps[comp])]
        moved = 2 * max((nbytes([s]) for s in ins.shapes), default=0.0)
      op = Op(
        ins.name,
        ins.opcode,
        kind,
        source,
        flops,
        moved,
        note=note,
        runs=times,
        computation=comp,
        costed=chip is not None,
      )
      if collectives:
        _add_collective(op, ins, collectives, seen_channels, partitions, by_name, chip, ragged_rows)
      if chip is not None:
        cycles = _estimated_cycles(ins) if chip.clock_hz else None
        if op.collective and not flops:
          op.compute_seconds = 0.0  # a transfer (and its reduction): its wire time stands for it
        elif cycles is not None:
          op.compute_seconds, op.timing = cycles / chip.clock_hz, "xla estimate"
        else:
          op.compute_seconds, op.timing = roofline_seconds(op.flops, op.bytes, chip.peaks), "roofline / efficiency"
      if times > 1:
        op.flops, op.bytes, op.wire = op.flops * times, op.bytes * times, op.wire * times
        op.compute_seconds, op.wire_seconds = op.compute_seconds * times, op.wire_seconds * times
        op.note = f"{op.note} x{times} (loop)".strip()
      ops.append(op)
  return ops


def program_time(text: str, chip: Chip, **kwargs) -> dict[str, float]:
  """summarize's totals of program_ops(text, chip=chip, **kwargs) with the schedule's: "seconds" serial,
  "scheduled_seconds" as the program's order plays out, "exposed_collective_seconds"."""
  ops = program_ops(text, chip=chip, **kwargs)
  timed = schedule(text, ops, chip)
  return dict(
    summarize(ops), scheduled_seconds=timed["seconds"], exposed_collective_seconds=timed["exposed_collective_seconds"]
  )


def _dcn_op(ins: _Instr, comp: str, times: int, source: str, seen: dict, by_name, chip: Chip | None) -> Op:
  """A cross-slice transfer (XLA:TPU hands it to the DCN runtime as a send and a recv of one chip's shard, which
  share a rendezvous name): its wire bytes and time at the send or recv that comes first."""
  transfer = re.search(r'_xla_megascale_transfer_type="(\w+)"', ins.attrs).group(1)
  key = "dcn:" + (re.search(r'_xla_host_transfer_rendezvous="([^"]*)"', ins.attrs) or [None, ins.name])[1]
  op = Op(
    ins.name,
    ins.opcode,
    f"dcn {transfer.lower().replace('_', '-')}",
    source,
    0.0,
    0.0,
    runs=times,
    computation=comp,
    collective=key,
    costed=chip is not None,
  )
  if key in seen:
    return op  # the other half of the pair: nothing more moves
  seen[key] = [op]
  op.role = "start"
  size = (
    nbytes(by_name[ins.operands[0]].shapes)
    if ins.opcode == "send" and ins.operands
    else max((nbytes([s]) for s in ins.shapes), default=0.0)
  )
  if chip is not None and chip.torus is not None:
    op.wire, op.wire_seconds = ici.dcn_seconds(chip.torus, transfer, size)
    op.wire, op.wire_seconds = op.wire * times, op.wire_seconds * times
  return op


def _producers(ins: _Instr, by_name: dict[str, _Instr]) -> set[str]:
  """The instructions whose results `ins` reads, seen through get-tuple-element and bitcast."""
  found = set()
  for name in ins.operands:
    while name in by_name and by_name[name].opcode in ("get-tuple-element", "bitcast") and by_name[name].operands:
      name = by_name[name].operands[0]
    found.add(name)
  return found


def _add_collective(
  op: Op,
  ins: _Instr,
  collectives,
  seen: dict[str, list[Op]],
  partitions: int,
  by_name,
  chip: Chip | None,
  ragged_rows: RaggedModel | None,
) -> None:
  """Marks op as part of a logical collective (by channel: an async collective fusion's start, continuations and
  done hold the same one) and, at its first op, charges the collective's wire bytes and time."""
  inner, comp = collectives[0]
  channel = _channel(inner) or inner.name
  chain = seen.get(channel)
  if chain is not None and chain[-1].name in _producers(ins, by_name):  # the next piece of an async collective
    first = chain[0]
    op.collective, op.role, op.kind = first.collective, "continue", first.kind
    if first.role == "sync":
      first.role = "start"
    chain.append(op)
    return
  # A new logical collective (jax's channel ids repeat, e.g. shard_map's psums cloned by XLA).
  op.collective = channel if chain is None else f"{channel}.{op.name}"
  seen[channel] = [op]
  op.role = "start" if ins.opcode.endswith("-start") else "sync"
  kind = _collective_kind(inner, comp)
  op.kind = kind if op.opcode != "fusion" or not op.flops else f"{kind} + matmul"
  size = _collective_bytes(inner, kind, by_name)
  if kind == "ragged-all-to-all":
    rows = ragged_rows(inner) if ragged_rows else None
    full_rows = (ragged_buffer(inner) or (1,))[0]
    size = size * min(1.0, rows / full_rows) if rows is not None else size
    op.note = "real rows only" if rows is not None else "whole buffer"
  if kind == "collective-permute":
    pairs, groups = source_target_pairs(inner), None
    op.wire = size if pairs else 0.0
  else:
    pairs, groups = None, replica_groups(inner, partitions)
    g = len(groups[0])
    op.wire = size * (g - 1) / g * (2 if kind == "all-reduce" else 1)
  if chip is None:
    return
  if chip.torus is None:
    op.wire_seconds = op.wire / chip.peaks.ici_bytes_per_s
  else:
    op.wire_seconds = ici.collective_seconds(chip.torus, kind, groups, size, pairs)


def op_seconds(op: Op, peaks: Peaks | None = None) -> float:
  """An op's serial time: its compute and its collective's wire time (both all runs). Ops costed without a chip
  (program_ops(chip=None)) get the roofline at full peak and wire over all links."""
  if op.costed or peaks is None:
    return op.compute_seconds + op.wire_seconds
  return max(op.flops / peaks.bf16_flops, op.bytes / peaks.hbm_bytes_per_s) + op.wire / peaks.ici_bytes_per_s


def summarize(ops: list[Op], peaks: Peaks | None = None) -> dict[str, float]:
  """Totals of a program's ops; "seconds" is the serial step (every op and collective one after another)."""
  compute = sum(op_seconds(dataclasses.replace(o, wire=0.0, wire_seconds=0.0), peaks) for o in ops)
  wire = sum(op_seconds(dataclasses.replace(o, flops=0.0, bytes=0.0, compute_seconds=0.0), peaks) for o in ops)
  return {
    "flops": sum(o.flops for o in ops),
    "hbm_bytes": sum(o.bytes for o in ops),
    "wire_bytes": sum(o.wire for o in ops),
    "compute_seconds": compute,
    "collective_seconds": wire,
    "seconds": compute + wire,
  }


def schedule(text: str, ops: list[Op], chip: Chip) -> dict[str, float]:
  """The program's time played out in its own instruction order (XLA:TPU's optimized HLO is scheduled), with one
  compute stream, one interconnect queue and one copy engine:
    - an op's compute runs when the one before it ends (compute_seconds a run);
    - a collective that is one synchronous op waits for the interconnect and holds compute for its wire time (or
      its compute, if longer); one split over ops (a start and a done, or an async collective fusion) enters the
      interconnect queue at its start and holds compute only at its done, until it has finished: the ops between
      overlap with it; a done whose start is not in the same computation (a loop-carried collective) ends one
      that started with the computation;
    - an async copy (copy-start / copy-done, dynamic-slice-start / -done, ...: moves between memory spaces,
      host offload included) runs on the copy engine at HBM bandwidth, a cross-slice transfer
      (send / recv to the DCN runtime, ended by its send-done / recv-done) on the data-center network's queue;
    - a while loop takes its trip count times its body (and condition), a call its computation, a conditional its
      longest branch (of those with ops: a branch program_ops was told does not run has none).
  Returns {"seconds": the step, "serial_seconds": summarize's, "exposed_collective_seconds": the time compute waited
  on collectives, "overlapped_collective_seconds": wire time hidden under compute}."""
  comps, entry, by_name = parse_module(text)
  index = {(o.computation, o.name): o for o in ops}

  def run(comp: str, seen: tuple = ()) -> tuple[float, float]:
    """(seconds, of which compute waited on collectives) for one run of a computation."""
    if comp in seen:
      return 0.0, 0.0
    last = {}  # a split collective's last op in this computation: its done
    for ins in comps.get(comp, ()):
      op = index.get((comp, ins.name))
      if op is not None and op.collective and op.role in ("start", "continue"):
        last[op.collective] = ins.name
    t = ici_free = dcn_free = dma_free = wait = 0.0
    pending: dict[str, float] = {}

    def finish(key: str) -> None:
      nonlocal t, wait
      end = pending.pop(key, t)
      wait += max(0.0, end - t)
      t = max(t, end)

    for ins in comps.get(comp, ()):
      if ins.opcode in ("while", "call", "conditional"):
        inner = seen + (comp,)
        if ins.opcode == "while":
          trips = trip_count(ins, comps, by_name) or 1
          body = run((_attr(ins.attrs, "body") or "").lstrip("%"), inner)
          cond = run((_attr(ins.attrs, "condition") or "").lstrip("%"), inner)
          t, wait = t + trips * (body[0] + cond[0]) + cond[0], wait + trips * body[1]
        else:
          branch = max((run(c, inner) for c in called_computations(ins)), default=(0.0, 0.0))
          t, wait = t + branch[0], wait + branch[1]
        continue
      op = index.get((comp, ins.name))
      if op is None:
        continue
      runs = max(op.runs, 1)
      compute, wire = op.compute_seconds / runs, op.wire_seconds / runs
      if op.role == "done":  # a *-done: its start is its operand
        started = index.get((comp, op.collective))
        if started is not None and not started.collective and started.opcode.endswith("-start"):
          t = max(t, pending.pop(started.name, t))
        else:
          finish(started.collective if started is not None and started.collective else op.collective)
      elif op.opcode.endswith("-start") and not op.collective and op.opcode != "custom-call-start":
        begin = max(t, dma_free)  # copy-start, dynamic-slice-start, ...: a DMA beside compute
        dma_free = pending[op.name] = begin + op.bytes / runs / chip.peaks.hbm_bytes_per_s
      elif op.role == "sync":
        begin = max(t, ici_free)
        wait += begin - t + wire
        t = ici_free = begin + max(wire, compute)
      elif op.role == "start" and op.collective.startswith("dcn:"):  # the data-center network: a queue of its own
        begin = max(t, dcn_free)
        dcn_free = pending[op.collective] = begin + wire
      elif op.role == "start":
        begin = max(t, ici_free)
        ici_free = pending[op.collective] = begin + wire
        t += compute
      elif op.role == "continue" and last.get(op.collective) == ins.name:  # an async collective fusion's done
        finish(op.collective)
        t += compute
      else:
        t += compute
    return max([t] + list(pending.values())), wait

  total, waited = run(entry)
  serial = summarize(ops, chip.peaks)
  return {
    "seconds": total,
    "serial_seconds": serial["seconds"],
    "exposed_collective_seconds": waited,
    "overlapped_collective_seconds": max(0.0, serial["collective_seconds"] - waited),
  }


def source_key(op: Op) -> str:
  """A short name for the table of where the cost goes: the op's kind and the tail of jax's op name (the
  primitive and what it sits in), without the jit / while / transpose scaffolding."""
  parts = [
    p
    for p in op.op_name.split("/")
    if p
    and not re.fullmatch(
      r"jit\(step\)|while|body|closed_call|cond|checkpoint|rematted_computation|jvp\(\)|transpose\(jvp\(\)\)|"
      r"jit\(\w+\)|shard_map|pjit|remat",
      p,
    )
  ]
  tail = "/".join(parts[-2:]) if parts else "?"
  return f"{op.kind}: {tail}"


def by_source(ops: list[Op], peaks: Peaks | None = None) -> dict[str, dict[str, float]]:
  table: dict[str, dict[str, float]] = {}
  for o in ops:
    row = table.setdefault(
      source_key(o), {"flops": 0.0, "hbm_bytes": 0.0, "wire_bytes": 0.0, "seconds": 0.0, "count": 0}
    )
    row["flops"] += o.flops
    row["hbm_bytes"] += o.bytes
    row["wire_bytes"] += o.wire
    row["seconds"] += op_seconds(o, peaks)
    row["count"] += 1
  return table
