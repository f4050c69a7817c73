"""The cost of a compiled XLA program op by op, read from its optimized HLO text, and a roofline time for it.

XLA's `cost_analysis()` gives totals only, and its TPU `optimal_seconds` comes out negative for large programs:
some fusions carry `"estimated_cycles":"9223372036854775807"` (2^63 - 1, no estimate) in their backend config and
the sum overflows. So each instruction the program runs at the top level (a fusion, a Pallas kernel, a collective,
a copy, ...) becomes one `Op`, counted as many times as it runs: a while loop's body times its known trip count
(XLA's own cost_analysis counts a loop body once, which undercounts chunked attention and losses):
  flops    matmul FLOPs: 2 x result elements x contracted size for every dot and convolution it holds. A Pallas
           kernel (tpu_custom_call) has no HLO inside: its `cost_estimate` as its pallas_call declared it, unless
           a kernel model passed to `program_ops` replaces it (grouped_matmul.megablox_grid_cost: the tiles its
           grid really visits for a stated routing, where megablox declares the whole static buffer).
  bytes    HBM traffic: the bytes of its operands and results (what a fusion computes inside stays on chip), except
           where only a slice moves: an operand a dynamic-slice reads (a scanned layer's weights out of their
           stack, at top level or inside a fusion) counts the slice, and a buffer a dynamic-update-slice writes in
           place (the KV cache, a scan's stacked outputs) counts the update, read and written.
  wire     for a collective, the bytes one chip sends or receives over ICI: (g - 1) / g of the gathered,
           scattered or exchanged array for a group of g chips, twice that for an all-reduce; for a ragged
           all-to-all only the real rows (the `real_rows` model: the static buffer is sized for the worst case).
Roofline (`roofline`): an op takes max(flops / peak FLOP/s, bytes / HBM bandwidth), a collective wire / ICI
bandwidth; the step is their sum (nothing overlapped: an upper bound for a well-scheduled program, a lower bound
for one that stalls). Peaks per TPU generation are in PEAKS.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Peaks:
  bf16_flops: float  # FLOP/s a chip, dense bf16
  hbm_bytes_per_s: float  # HBM bandwidth a chip
  ici_bytes_per_s: float  # inter-chip interconnect bandwidth a chip, all links
  source: str


# Google Cloud's published per-chip figures (cloud.google.com/tpu/docs/<generation>): peak bf16 compute, HBM
# bandwidth, ICI bandwidth (published in Gbps; / 8 here).
PEAKS: dict[str, Peaks] = {
    "v4": Peaks(275e12, 1228e9, 2400e9 / 8, "cloud.google.com/tpu/docs/v4"),
    "v5e": Peaks(197e12, 819e9, 1600e9 / 8, "cloud.google.com/tpu/docs/v5e"),
    "v5p": Peaks(459e12, 2765e9, 4800e9 / 8, "cloud.google.com/tpu/docs/v5p"),
    "v6e": Peaks(918e12, 1640e9, 3584e9 / 8, "cloud.google.com/tpu/docs/v6e"),
}

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
                "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%(\S+)\s+=\s+(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%(\S+)\s.*\{\s*$")
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
               "replica-id", "opt-barrier", "while", "call", "conditional", "add-dependency"}
COLLECTIVES = {"all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute",
               "all-gather-start", "all-reduce-start", "collective-permute-start", "all-to-all-start",
               "ragged-all-to-all-start", "reduce-scatter-start"}


@dataclasses.dataclass
class Op:
  name: str
  opcode: str  # fusion, custom-call, all-gather-start, copy-start, ...
  kind: str  # what it is for the tables: "matmul fusion", "fusion", "pallas <kernel>", a collective, ...
  op_name: str  # jax's name for the source op (metadata op_name)
  flops: float
  bytes: float
  wire: float = 0.0  # bytes over ICI (collectives)
  note: str = ""


def array_shapes(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, dims) of every array in an HLO type (one array or a tuple), layouts ignored."""
  return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(type_text)
          if dt in _DTYPE_BYTES]


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
  return re.findall(r"%([\w.\-]+)", rest[:i - 1]), rest[i:]


def parse_module(text: str) -> tuple[dict[str, list[_Instr]], str, dict[str, _Instr]]:
  """(computations by name, the entry's name, every instruction by name)."""
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


def _group_size(attrs: str) -> int:
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)  # iota form [groups, size]<=[devices]
  if m:
    return int(m.group(2))
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"source_target_pairs=\{", attrs)
  return 2 if m else 1


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
  if (cond is None or body is None or init is None or cond.opcode != "compare" or "direction=LT" not in cond.attrs
      or len(cond.operands) != 2 or body.opcode != "tuple" or init.opcode != "tuple"):
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


def _executed(comps, entry, by_name) -> dict[str, int]:
  """{computation: how many times it runs in one run of the program} for the computations that run as control
  flow (the entry, while bodies and conditions, called computations, conditional branches), not fused or reducer
  computations. A while loop's body runs its known trip count times its caller's count (once when XLA does not
  know the count)."""
  times, order = {entry: 1}, [entry]
  for comp in order:
    for ins in comps.get(comp, ()):
      if ins.opcode != "fusion":
        k = (trip_count(ins, comps, by_name) or 1) if ins.opcode == "while" else 1
        for n in called_computations(ins):
          if n not in times:
            times[n] = times[comp] * k
            order.append(n)
  return times


def op_name(ins: _Instr) -> str:
  """jax's name for the instruction's source op (its metadata op_name), or ""."""
  m = re.search(r'op_name="([^"]*)"', ins.attrs)
  return m.group(1) if m else ""


KernelModel = Callable[[str, _Instr, dict], "tuple[float, float, str] | None"]
RaggedModel = Callable[[_Instr], "float | None"]


_PASS_THROUGH = {"bitcast", "reshape", "copy", "convert"}  # a slice read through these is still a slice


def _params(comp: list[_Instr]) -> dict[int, str]:
  """{parameter number: its instruction's name} of a computation."""
  return {int(m.group(1)): i.name for i in comp
          if i.opcode == "parameter" and (m := re.search(r"parameter\((\d+)\)", i.line))}


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
        inner = [_slice_reads(params[j], nested, comps) if j in params else None
                 for j, o in enumerate(use.operands) if o == name]
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
    outs = [root] if root is not None and root.opcode != "tuple" else [
        next((i for i in comp if i.name == o), None) for o in (root.operands if root is not None else [])]
    if outs and all(o is not None and o.opcode == "dynamic-update-slice" for o in outs):
      result = sum(_update_bytes(o, comp) for o in outs)  # written in place: only the updates move
  return sum(operands) + result


def program_ops(text: str, *, kernel_model: KernelModel | None = None, ragged_rows: RaggedModel | None = None
                ) -> list[Op]:
  """Every top-level op of the compiled program's HLO text with its FLOPs, HBM bytes and wire bytes.

  kernel_model(op_name, instruction, instructions by name) -> (flops, bytes, note) or None: the cost of a Pallas
  kernel as its grid runs (None: keep the kernel's declared cost_estimate).
  ragged_rows(instruction) -> the real rows a ragged all-to-all moves (None: its whole result)."""
  comps, entry, by_name = parse_module(text)
  ops = []
  for comp, times in _executed(comps, entry, by_name).items():
    for ins in comps[comp]:
      if ins.opcode in _NO_TRAFFIC or ins.opcode.endswith("-done"):
        continue
      source = op_name(ins)
      moved = _moved_bytes(ins, comps, by_name)
      flops, wire, note, kind = matmul_flops(ins, by_name), 0.0, "", ins.opcode
      if ins.opcode == "fusion":
        flops = _fused_flops((_attr(ins.attrs, "calls") or "").lstrip("%"), comps, by_name)
        kind = "matmul fusion" if flops else "fusion"
      elif ins.opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in ins.attrs:
        kernel = re.search(r"jit\((\w+)\)/pallas_call", source)  # megablox: jit(gmm); else the instruction's name
        kind = "pallas " + (kernel.group(1) if kernel else re.sub(r"[.]\d+$", "", ins.name))
        declared = re.search(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"\d+","bytes_accessed":"(\d+)"',
                             ins.attrs)
        flops, moved = (float(declared.group(1)), float(declared.group(2))) if declared else (0.0, moved)
        note = "declared cost_estimate" if declared else "no cost_estimate"
        modeled = kernel_model(source, ins, by_name) if kernel_model else None
        if modeled is not None:
          flops, moved, note = modeled
      elif ins.opcode.endswith("-start") and ins.opcode not in COLLECTIVES:  # copy-start: (dst, src, context)
        moved = 2 * max((nbytes([s]) for s in ins.shapes), default=0.0)
      elif ins.opcode in COLLECTIVES:
        kind = ins.opcode.removesuffix("-start")
        g = _group_size(ins.attrs)
        # An async start's result tuple holds the operand and the result: count the largest array once.
        size = max((nbytes([s]) for s in ins.shapes), default=0.0)
        if kind == "ragged-all-to-all":
          rows = ragged_rows(ins) if ragged_rows else None
          full_rows = ins.shapes[0][1][0] if ins.shapes and ins.shapes[0][1] else 1
          size = size * min(1.0, rows / full_rows) if rows is not None else size
          note = "real rows only" if rows is not None else "whole buffer"
        wire = size * (g - 1) / g * (2 if kind == "all-reduce" else 1)
        moved = 2 * size
      if times > 1:
        flops, moved, wire, note = flops * times, moved * times, wire * times, f"{note} x{times} (loop)".strip()
      ops.append(Op(ins.name, ins.opcode, kind, source, flops, moved, wire, note))
  return ops


def op_seconds(op: Op, peaks: Peaks) -> float:
  return max(op.flops / peaks.bf16_flops, op.bytes / peaks.hbm_bytes_per_s) + op.wire / peaks.ici_bytes_per_s


def summarize(ops: list[Op], peaks: Peaks) -> dict[str, float]:
  compute = sum(max(o.flops / peaks.bf16_flops, o.bytes / peaks.hbm_bytes_per_s) for o in ops)
  wire = sum(o.wire for o in ops) / peaks.ici_bytes_per_s
  return {"flops": sum(o.flops for o in ops), "hbm_bytes": sum(o.bytes for o in ops),
          "wire_bytes": sum(o.wire for o in ops), "compute_seconds": compute, "collective_seconds": wire,
          "seconds": compute + wire}


def source_key(op: Op) -> str:
  """A short name for the table of where the cost goes: the op's kind and the tail of jax's op name (the
  primitive and what it sits in), without the jit / while / transpose scaffolding."""
  parts = [p for p in op.op_name.split("/") if p and not re.fullmatch(
      r"jit\(step\)|while|body|closed_call|cond|checkpoint|rematted_computation|jvp\(\)|transpose\(jvp\(\)\)|"
      r"jit\(\w+\)|shard_map|pjit|remat", p)]
  tail = "/".join(parts[-2:]) if parts else "?"
  return f"{op.kind}: {tail}"


def by_source(ops: list[Op], peaks: Peaks) -> dict[str, dict[str, float]]:
  table: dict[str, dict[str, float]] = {}
  for o in ops:
    row = table.setdefault(source_key(o), {"flops": 0.0, "hbm_bytes": 0.0, "wire_bytes": 0.0, "seconds": 0.0,
                                            "count": 0})
    row["flops"] += o.flops
    row["hbm_bytes"] += o.bytes
    row["wire_bytes"] += o.wire
    row["seconds"] += op_seconds(o, peaks)
    row["count"] += 1
  return table


