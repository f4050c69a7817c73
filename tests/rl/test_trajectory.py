"""Token-exact trajectories (glm_jax/rl/trajectory.py) against hand-built sequences: a scripted policy's episode
equals the tokenization of hand-written chat text piece by piece, loss mask 1 exactly on the sampled ids; the
model's own ids are kept as sampled; a conversation that would re-render an earlier turn is refused by turn."""

import numpy as np
import pytest

from glm_jax import chat
from glm_jax.data import default_data_config, load_tokenizer
from glm_jax.rl.trajectory import NotAppendOnly, Trajectory

CALC = {
  "type": "function",
  "function": {
    "name": "calc",
    "description": "Evaluates arithmetic.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
  },
}
USER = [{"role": "user", "content": "What is 37*91?"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  cfg = default_data_config()
  cfg.cache_dir = str(tmp_path_factory.mktemp("cache"))
  return load_tokenizer(cfg)


def test_a_scripted_tool_episode_is_the_hand_built_sequence(tok):
  traj = Trajectory(tok, USER, version=7)
  first = "Use the calculator.</think><tool_call>calc<arg_key>expr</arg_key><arg_value>37*91</arg_value></tool_call>"
  sample1 = tok.encode_chat(first + "<|observation|>")
  parsed = traj.add_sample(sample1, np.linspace(-1, -0.1, len(sample1)))
  assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "calc", "arguments": {"expr": "37*91"}}}]
  obs = traj.add_observation([{"role": "tool", "content": "3367"}])
  sample2 = tok.encode_chat("It is 3367.</think>37*91 = 3367.<|endoftext|>")
  traj.add_sample(sample2, [-0.5] * len(sample2))

  pieces = [  # (hand-written text, loss mask)
    ("[gMASK]<sop><|user|>What is 37*91?<|assistant|><think>", 0),
    (first + "<|observation|>", 1),
    ("<tool_response>3367</tool_response><|assistant|><think>", 0),
    ("It is 3367.</think>37*91 = 3367.<|endoftext|>", 1),
  ]
  expected = [i for text, _ in pieces for i in tok.encode_chat(text)]
  assert traj.tokens == expected
  assert traj.loss_mask == [m for text, m in pieces for _ in tok.encode_chat(text)]
  assert obs == tok.encode_chat(pieces[2][0])  # <|observation|> was the model's stop token: not written twice
  assert traj.tokens == tok.encode_chat(traj.text)  # canonical samples: the whole text tokenizes to the sequence
  assert traj.text == "".join(text for text, _ in pieces)
  n0, n1, n2 = (len(tok.encode_chat(t)) for t, _ in pieces[:3])
  assert [(s.kind, s.turn, s.start, s.end) for s in traj.spans] == [
    ("prompt", 0, 0, n0),
    ("sample", 1, n0, n0 + n1),
    ("observation", 1, n0 + n1, n0 + n1 + n2),
    ("sample", 2, n0 + n1 + n2, len(expected)),
  ]
  np.testing.assert_allclose(traj.logprobs[n0 : n0 + n1], np.linspace(-1, -0.1, n1), rtol=1e-6)
  assert traj.logprobs[:n0] == [0.0] * n0 and traj.version == 7 and traj.turns == 2
  # The conversation the parser read back is the one the template renders: text == render(messages) + the stop.
  assert (
    traj.messages[1]["reasoning_content"] == "Use the calculator." and traj.messages[3]["content"] == "37*91 = 3367."
  )
  assert chat.render(traj.messages) + "<|endoftext|>" == traj.text


def test_the_models_ids_are_kept_as_sampled_and_a_missing_stop_is_written(tok):
  traj = Trajectory(tok, USER, tools=[CALC], enable_thinking=False)
  text = "<tool_call>calc<arg_key>expr</arg_key><arg_value>37*91</arg_value></tool_call>"
  odd = [i for piece in ["<tool_call>", "calc"] for i in tok.encode_chat(piece)]  # "calc" as the model spelled it:
  odd = odd[:1] + [i for ch in "calc" for i in tok.encode(ch)]  # one id a letter, not the tokenizer's reading
  odd += tok.encode_chat(text[len("<tool_call>calc") :])
  assert odd != tok.encode_chat(text)
  parsed = traj.add_sample(odd, [-1.0] * len(odd))  # stopped by max tokens: no stop token
  assert parsed["tool_calls"][0]["function"]["arguments"] == {"expr": "37*91"}  # typed by the schema: a string
  n = traj.spans[1].start
  assert traj.tokens[n:] == odd and traj.stop is None
  obs = traj.add_observation([{"role": "tool", "content": "3367"}])
  assert obs == tok.encode_chat("<|observation|><tool_response>3367</tool_response><|assistant|></think>")
  assert tok.decode(traj.tokens) == traj.text


def _sample(traj, text):
  ids = traj.tokenizer.encode_chat(text)
  return traj.add_sample(ids, [-0.25] * len(ids))


def test_two_tool_results_then_a_user_reply_with_preserved_reasoning(tok):
  traj = Trajectory(tok, USER, clear_thinking=False)
  _sample(traj, "Two calls.</think><tool_call>a</tool_call><tool_call>b</tool_call><|observation|>")
  obs = traj.add_observation([{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}])
  assert tok.decode(obs) == "<tool_response>1</tool_response><tool_response>2</tool_response><|assistant|><think>"
  _sample(traj, "Done.</think>1 and 2<|user|>")
  obs = traj.add_observation([{"role": "user", "content": "thanks"}])
  assert obs == tok.encode_chat("thanks<|assistant|><think>")  # after the model's <|user|>: read on its own
  assert traj.tokens == tok.encode_chat(traj.text)
  assert traj.text == chat.render(traj.messages, add_generation_prompt=True, clear_thinking=False)


def test_what_would_change_an_earlier_token_is_refused_by_turn(tok):
  traj = Trajectory(tok, USER)  # clear_thinking=True: a user reply collapses the reasoning of turn 1
  _sample(traj, "Think first.</think>Hello<|user|>")
  with pytest.raises(
    NotAppendOnly,
    match=r"turn 1 \(messages\[2:3\]\): the conversation does not render append-only.*"
    r"clear_thinking=False",
  ):
    traj.add_observation([{"role": "user", "content": "more"}])
  n = len(traj.tokens)
  with pytest.raises(NotAppendOnly, match="turn 2: a sample follows sample 1"):
    _sample(traj, "x")
  assert len(traj.tokens) == n and len(traj.messages) == 2  # nothing appended by the refusals
  fresh = Trajectory(tok, USER)
  with pytest.raises(NotAppendOnly, match="turn 0: an observation must follow a sample"):
    fresh.add_observation([{"role": "tool", "content": "1"}])
  with pytest.raises(ValueError, match="turn 1: 2 sampled ids but 1 log-probabilities"):
    fresh.add_sample([5, 6], [0.0])
  _sample(fresh, "ok<|observation|>")
  with pytest.raises(ValueError, match=r"messages\[2\]\.role: 'robot' is not a role"):
    fresh.add_observation([{"role": "robot", "content": "1"}])


def test_arrays_pad_with_mask_zero(tok):
  traj = Trajectory(tok, USER)
  _sample(traj, "x</think>y<|endoftext|>")
  n = len(traj.tokens)
  out = traj.arrays(n + 3)
  assert out["tokens"].tolist() == traj.tokens + [tok.pad_id] * 3
  assert out["loss_mask"].tolist() == traj.loss_mask + [0] * 3 and out["logprobs"][n:].tolist() == [0.0] * 3
  with pytest.raises(ValueError, match=f"length={n - 1} is shorter than the episode's {n} tokens"):
    traj.arrays(n - 1)
