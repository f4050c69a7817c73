"""The special tokens every tokenizer of ours has, reserved from the start for GLM's objectives and chat format.

  <|pad|> (id 0 in the trained BPE), <|endoftext|> (eos, ends every document), [MASK], [gMASK], <sop>, <eop>,
  [sMASK] (GLM's sentence blanks; added after the first six, so they keep their ids), then GLM-5's chat format's
  tokens (glm_jax/chat.py FORMAT_TOKENS: role tokens and tags, ids 7..20 of the trained BPE).
ROLES maps each role to the token added when a given tokenizer.json lacks it and the names accepted for it
there (glm_jax/data/tokenizer.py); the data config's checks read SPECIAL_TOKENS too. The chat tokens are not
roles: a given tokenizer.json that lacks them is not changed, and only chatting with it is refused.
"""

from glm_jax.chat import FORMAT_TOKENS

PAD, EOS, MASK, GMASK, SOP, EOP, SMASK = "<|pad|>", "<|endoftext|>", "[MASK]", "[gMASK]", "<sop>", "<eop>", "[sMASK]"
SPECIAL_TOKENS = (PAD, EOS, MASK, GMASK, SOP, EOP, SMASK, *FORMAT_TOKENS)  # ids 0..20 of the trained BPE, in order
ROLES = {  # role -> (the token added when missing, the names accepted for it in a given tokenizer.json)
  "pad": (PAD, (PAD, "<pad>", "[PAD]")),
  "eos": (EOS, (EOS, "</s>", "<eos>", "<|end_of_text|>")),
  "mask": (MASK, (MASK,)),
  "gmask": (GMASK, (GMASK,)),
  "sop": (SOP, (SOP, "[sop]")),
  "eop": (EOP, (EOP, "[eop]")),
  "smask": (SMASK, (SMASK,)),
}
