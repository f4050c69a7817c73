"""Batched sampling with a KV cache: one prefill over the prompts, then one jit-compiled decode step a token.

  sampler = Sampler(graphdef, model_cfg, SamplingParams(max_new_tokens=64, temperature=1.0, stop_ids=(tok.eos_id,)))
  out = sampler(params, rest, prompts, jax.random.key(0))     # prompts: lists of token ids
  out.tokens[b, :out.lengths[b]]      prompt b followed by its response
  out.logp[b, s], out.response_mask   per-token log-probabilities of the response tokens

Prompts may have different lengths: prompt b fills slots 0..len_b-1 of its row and its response continues at len_b
(glm_jax/model/kv_cache.py). The whole generation is one jax.jit (the prefill, then a lax.while_loop of decode steps
until every row has stopped or max_new_tokens are out), compiled once a prompt width and batch size. GLM's blank
infilling (glm_jax/inference/infill.py): a prompt may carry its own rope (and block) positions and a bidirectional
prefix; a generated token inside a blank (last block position > 0) keeps the position and counts the block position
up, GLM's rule, else the position counts up. Under a mesh (`Sampler(..., mesh=mesh)`) the same program runs sharded,
with the one-device output (docs/serving.md, "The sampler, the engine, the server, the router"); a batch or heads the
mesh does not divide are refused by name. Log-probabilities are those of the distribution drawn from before top-p:
`tempered_log_softmax`, which a trainer that recomputes them must use too (glm_jax/rl/step.py's token_logprobs does).
A non-finite log-probability of a generated token raises FloatingPointError.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from glm_jax.inference import speculative
from glm_jax.inference.sampling import SampleOutput, SamplingParams, sample_token
from glm_jax.mesh_axes import BATCH_AXES, TENSOR
from glm_jax.model.config import ModelConfig
from glm_jax.sharding.state import weight_shardings


def _generate(
  graphdef,
  params,
  rest,
  prompts_BT,
  prompt_lens_B,
  key,
  layout,
  *,
  sampling: SamplingParams,
  cache_len: int,
  return_logits: bool,
  constrain_cache=None,
) -> SampleOutput:
  """layout: None (positions = slots, causal prompts) or (positions [B, T], block_positions [B, T] or None,
  prefix_lens [B]) for GLM's blank infilling. constrain_cache: lays the cache out on the mesh (Sampler._sharded)."""
  model = nnx.merge(graphdef, params, rest)
  b, p = prompts_BT.shape
  rows = jnp.arange(b)
  if layout is None:
    logits_BTV, cache = model.prefill(prompts_BT, cache_len)
    next_rope = None
  else:
    pos_BT, block_BT, prefix_B = layout
    logits_BTV, cache = model.prefill(
      prompts_BT,
      cache_len,
      positions=pos_BT,
      block_positions=block_BT,
      prefix_end=jnp.broadcast_to(prefix_B[:, None], (b, p)),
    )
    last = prompt_lens_B - 1
    last_pos, last_block = pos_BT[rows, last], (None if block_BT is None else block_BT[rows, last])

    def next_rope(slot_B):  # GLM's rule (module docstring)
      ahead = slot_B - last
      if last_block is None:
        return last_pos + ahead, None
      in_blank = last_block > 0
      return (jnp.where(in_blank, last_pos, last_pos + ahead), jnp.where(in_blank, last_block + ahead, 0))

  if constrain_cache is not None:
    cache = constrain_cache(cache)
  first_BV = logits_BTV[rows, prompt_lens_B - 1]
  stop_ids = jnp.asarray(sampling.stop_ids or (-1,), jnp.int32)
  tokens = jnp.full((b, cache_len), sampling.pad_id, jnp.int32).at[:, :p].set(prompts_BT)
  tokens = jnp.where(jnp.arange(cache_len)[None] < prompt_lens_B[:, None], tokens, sampling.pad_id)
  state = dict(
    i=jnp.zeros((), jnp.int32),
    tokens=tokens,
    logp=jnp.zeros((b, cache_len), jnp.float32),
    mask=jnp.zeros((b, cache_len), bool),
    done=jnp.zeros((b,), bool),
    next_logits=first_BV,
    cache=cache,
    key=key,
  )
  if return_logits:
    state["logits"] = jnp.zeros((b, cache_len, first_BV.shape[-1]), jnp.float32)

  def cond(st):
    return (st["i"] < sampling.max_new_tokens) & ~jnp.all(st["done"])

  def body(st):
    key, sub = jax.random.split(st["key"])
    tok, logp = sample_token(st["next_logits"], sub, sampling.temperature, sampling.top_p)
    live = ~st["done"]
    tok = jnp.where(live, tok, sampling.pad_id)
    pos = prompt_lens_B + st["i"]
    new = dict(
      st,
      i=st["i"] + 1,
      key=key,
      tokens=st["tokens"].at[rows, pos].set(tok),
      logp=st["logp"].at[rows, pos].set(jnp.where(live, logp, 0.0)),
      mask=st["mask"].at[rows, pos].set(live),
      done=st["done"] | jnp.isin(tok, stop_ids),
    )
    if return_logits:
      new["logits"] = st["logits"].at[rows, pos].set(jnp.where(live[:, None], st["next_logits"], 0.0))
    if next_rope is None:
      new["next_logits"], new["cache"] = model.decode(tok, pos, st["cache"])
    else:
      rope_pos, block_pos = next_rope(pos)
      new["next_logits"], new["cache"] = model.decode(tok, pos, st["cache"], rope_pos_B=rope_pos, block_pos_B=block_pos)
    return new

  st = jax.lax.while_loop(cond, body, state)
  response_lens = jnp.sum(st["mask"], axis=-1).astype(jnp.int32)
  return SampleOutput(
    tokens=st["tokens"],
    logp=st["logp"],
    response_mask=st["mask"],
    prompt_lens=prompt_lens_B,
    lengths=prompt_lens_B + response_lens,
    finished=st["done"],
    logits=st.get("logits"),
  )


def pad_prompts(
  prompts: Sequence[Sequence[int]], pad_id: int, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads token lists to [B, width] (width: the longest prompt by default): (prompts, lengths)."""
  lens = np.asarray([len(p) for p in prompts], np.int32)
  width = int(lens.max()) if width is None else width
  out = np.full((len(prompts), width), pad_id, np.int32)
  for i, p in enumerate(prompts):
    out[i, : len(p)] = p
  return out, lens


def check_prompts(
  prompts: Sequence[Sequence[int]],
  cfg: ModelConfig,
  sampling: SamplingParams,
  cache_len: int | None,
  width: int | None = None,
  speculate: int = 0,
) -> int:
  """Validates prompts for a Sampler and returns the cache length (the prompt width plus max_new_tokens when
  cache_len is None); speculative decoding's `speculate` draft slots past it must lie within the model's positions
  too. Raises ValueError naming what is wrong."""
  if not len(prompts):
    raise ValueError("prompts: empty batch; need at least one prompt")
  for i, p in enumerate(prompts):
    if not len(p):
      raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
    bad = [t for t in p if not 0 <= int(t) < cfg.vocab_size]
    if bad:
      raise ValueError(f"prompts[{i}]: token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
  longest = max(len(p) for p in prompts)
  width = longest if width is None else width
  if width < longest:
    raise ValueError(f"prompt width {width} < the longest prompt ({longest} tokens)")
  needed = width + sampling.max_new_tokens
  if cache_len is None:
    cache_len = needed
  if needed > cache_len:
    raise ValueError(
      f"a prompt of {longest} tokens (padded to {width}) plus max_new_tokens="
      f"{sampling.max_new_tokens} needs {needed} cache slots; the cache has cache_len={cache_len}"
    )
  if cache_len + speculate > cfg.max_position_embeddings:
    extra = f" + speculate={speculate} draft slots" if speculate else ""
    raise ValueError(
      f"cache_len={cache_len}{extra} exceeds model.max_position_embeddings={cfg.max_position_embeddings}"
    )
  return cache_len


def check_heads(cfg: ModelConfig, mesh) -> None:
  """Decoding under `mesh` splits the attention heads over its tensor axis: a count it does not divide is named."""
  tensor = mesh.shape[TENSOR]
  if cfg.num_attention_heads % tensor:
    raise ValueError(
      f"decoding under a mesh: mesh.tensor={tensor} does not divide model.num_attention_heads="
      f"{cfg.num_attention_heads} (the decode's heads are split over it)"
    )


def batch_rows(mesh, batch: int) -> tuple[str, ...]:
  """The mesh's batch axes (of size > 1) that a decode batch's rows, and the cache's, are split over; a batch they
  do not divide is named."""
  axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
  shards = math.prod(mesh.shape[a] for a in axes)
  if batch % shards:
    raise ValueError(
      f"decoding under a mesh: a batch of {batch} rows; the mesh's batch axes "
      f"{dict((a, mesh.shape[a]) for a in axes)} split the rows {shards} ways: give a multiple of "
      f"{shards} rows (pad the batch)"
    )
  return axes


class Sampler:
  """Generation for one model and one SamplingParams: `Sampler(graphdef, cfg, sampling)(params, rest, prompts, key)`.
  The model is nnx.split(model, nnx.Param, ...)'s (graphdef, params, rest); prompts are lists of token ids.
  cache_len: the cache's slots (default: prompt width + max_new_tokens); width: pad prompts to this many tokens
  (a fixed width compiles once for prompts of any length). mesh: generate sharded over it (module docstring); the
  parameters are put in their layout on it unless they already have it. speculate=k (>= 1): MTP speculative
  decoding, k drafted tokens a round (glm_jax/inference/speculative.py; plain prompts only): the same tokens as
  plain decoding when greedy, the same distribution when sampling, and SampleOutput.rounds counts the rounds."""

  def __init__(
    self,
    graphdef,
    cfg: ModelConfig,
    sampling: SamplingParams,
    *,
    cache_len: int | None = None,
    width: int | None = None,
    return_logits: bool = False,
    mesh=None,
    speculate: int | None = None,
  ):
    self.cfg, self.sampling, self.cache_len, self.width = cfg, sampling, cache_len, width
    self._graphdef, self._return_logits = graphdef, return_logits
    self.mesh = None if mesh is None or mesh.size == 1 else mesh
    if self.mesh is not None:
      check_heads(cfg, self.mesh)
    if speculate:
      speculative.check(cfg, speculate)
    self.speculate = speculate or None
    self._jitted: dict[int, object] = {}  # cache_len -> the jitted generation

  def __call__(
    self,
    params,
    rest,
    prompts: Sequence[Sequence[int]],
    key: jax.Array,
    *,
    positions: Sequence[Sequence[int]] | None = None,
    block_positions: Sequence[Sequence[int]] | None = None,
    prefix_lens: Sequence[int] | None = None,
  ) -> SampleOutput:
    """positions / block_positions (one list per prompt, as long as it) and prefix_lens (the bidirectional
    prefix of each prompt): GLM's blank-infilling layout (glm_jax/inference/infill.py); none of them for plain
    prompts."""
    generate, args = self._program(params, rest, prompts, key, positions, block_positions, prefix_lens)
    with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
      out = generate(*args)
    finite_B = np.asarray(jnp.all(jnp.isfinite(out.logp) | ~out.response_mask, axis=-1))
    if not finite_B.all():
      rows = np.flatnonzero(~finite_B).tolist()
      raise FloatingPointError(
        f"sampling: rows {rows} drew tokens with a non-finite log-probability (temperature="
        f"{self.sampling.temperature}): the model's logits are NaN or infinite (non-finite weights?)"
      )
    return out

  def compile(self, params, rest, prompts: Sequence[Sequence[int]], key: jax.Array) -> None:
    """Compiles the generation for a batch shaped like `prompts` without running it: a later call on such a batch
    runs at once (jax keeps the executable), so that a caller can time the generation alone (launch/sample.py)."""
    generate, args = self._program(params, rest, prompts, key, None, None, None)
    with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
      generate.lower(*args).compile()

  def _program(self, params, rest, prompts, key, positions, block_positions, prefix_lens):
    """(the jitted generation for these prompts' cache length, its arguments), the prompts checked."""
    cache_len = check_prompts(prompts, self.cfg, self.sampling, self.cache_len, self.width, self.speculate or 0)
    prompts_BT, lens_B = pad_prompts(prompts, self.sampling.pad_id, self.width)
    layout = self._layout(prompts, prompts_BT.shape[1], positions, block_positions, prefix_lens)
    if self.speculate and layout is not None:
      raise ValueError(
        "speculate: speculative decoding takes plain prompts; positions, block_positions and "
        "prefix_lens (blank infilling) decode without it (speculate=None)"
      )
    args = (params, rest, jnp.asarray(prompts_BT), jnp.asarray(lens_B), key, layout)
    constrain_cache = None
    if self.mesh is not None:
      args, constrain_cache = self._sharded(args)
    if cache_len not in self._jitted:
      kw = dict(
        sampling=self.sampling, cache_len=cache_len, return_logits=self._return_logits, constrain_cache=constrain_cache
      )
      generate = functools.partial(speculative.generate, k=self.speculate) if self.speculate else _generate
      self._jitted[cache_len] = jax.jit(functools.partial(generate, self._graphdef, **kw))
    return self._jitted[cache_len], args

  def _sharded(self, args):
    """The generation's arguments put on the mesh (the parameters by their logical axes, every [B, ...] row-indexed
    array split over the batch axes) and a function laying a cache out there (every [..., B, S, W] array's rows
    where the prompts' are); a batch the batch axes do not divide is refused."""
    params, rest, prompts_BT, lens_B, key, layout = args
    mesh = self.mesh
    batch = batch_rows(mesh, prompts_BT.shape[0])
    params, rest = jax.device_put((params, rest), weight_shardings(params, rest, mesh))  # decoding's layout
    by_rows = NamedSharding(mesh, P(batch or None))
    prompts_BT, lens_B, layout = jax.device_put((prompts_BT, lens_B, layout), by_rows)

    def constrain_cache(cache):
      return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*[None] * (x.ndim - 3), batch or None))),
        cache,
      )

    return (params, rest, prompts_BT, lens_B, key, layout), constrain_cache

  def _layout(self, prompts, width: int, positions, block_positions, prefix_lens):
    """The blank-infilling layout as arrays (see _generate), or None for plain prompts."""
    if positions is None and block_positions is None and prefix_lens is None:
      return None
    if block_positions is not None and not self.cfg.rope_2d:
      raise ValueError("block_positions given, but model.rope_2d is False (a 1-D rope has no block position)")
    n = len(prompts)
    if positions is None:
      positions = [range(len(p)) for p in prompts]
    for name, rows in (("positions", positions), ("block_positions", block_positions)):
      if rows is not None and (len(rows) != n or any(len(r) != len(p) for r, p in zip(rows, prompts))):
        raise ValueError(
          f"{name}: need one list per prompt, as long as the prompt ({[len(p) for p in prompts]} "
          f"tokens); got lengths {[len(r) for r in rows]}"
        )
    prefix = np.zeros(n, np.int32) if prefix_lens is None else np.asarray(prefix_lens, np.int32)
    if prefix.shape != (n,) or (prefix < 0).any() or (prefix > [len(p) for p in prompts]).any():
      raise ValueError(f"prefix_lens={list(prefix_lens)}: need one length per prompt, each in [0, its length]")
    pos = jnp.asarray(pad_prompts(positions, 0, width)[0])
    block = None
    if self.cfg.rope_2d:
      block = jnp.asarray(pad_prompts(block_positions or [[0] * len(p) for p in prompts], 0, width)[0])
    return pos, block, jnp.asarray(prefix)
