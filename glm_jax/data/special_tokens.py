"""The special tokens every tokenizer of ours has, reserved from the start for GLM's objectives.

  <|pad|> (id 0 in the trained BPE), <|endoftext|> (eos, ends every document), [MASK], [gMASK], <sop>, <eop>,
  [sMASK] (GLM's sentence blanks; added last, so the first six keep their ids)
ROLES maps each role to the token added when a given tokenizer.json lacks it and the names accepted for it
there (glm_jax/data/tokenizer.py); the data config's checks read SPECIAL_TOKENS too.
"""

PAD, EOS, MASK, GMASK, SOP, EOP, SMASK = "<|pad|>", "<|endoftext|>", "[MASK]", "[gMASK]", "<sop>", "<eop>", "[sMASK]"
SPECIAL_TOKENS = (PAD, EOS, MASK, GMASK, SOP, EOP, SMASK)  # ids 0..6 of the trained BPE, in this order.
ROLES = {  # role -> (the token added when missing, the names accepted for it in a given tokenizer.json)
  "pad": (PAD, (PAD, "<pad>", "[PAD]")),
  "eos": (EOS, (EOS, "</s>", "<eos>", "<|end_of_text|>")),
  "mask": (MASK, (MASK,)),
  "gmask": (GMASK, (GMASK,)),
  "sop": (SOP, (SOP, "[sop]")),
  "eop": (EOP, (EOP, "[eop]")),
  "smask": (SMASK, (SMASK,)),
}
