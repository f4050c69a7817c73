"""Bad input stops before any work, with a message that names the field and the value."""

import pytest

from glm_jax.data import check_vocab, load_tokenizer, make_eval_batches, make_train_iterator, sources, unigram_entropy


def test_missing_data_path(make_cfg, tmp_path):
  missing = str(tmp_path / "nowhere" / "corpus.jsonl")
  with pytest.raises(FileNotFoundError, match=rf"data\.path='{missing}'"):
    load_tokenizer(make_cfg(source="jsonl", path=missing))
  with pytest.raises(FileNotFoundError, match=r"data\.path=''"):
    load_tokenizer(make_cfg(source="text", path=""))
  with pytest.raises(FileNotFoundError, match=r"data\.path='.*\*\.txt'.*no file matches"):
    sources.load_documents(make_cfg(source="text", path=str(tmp_path / "*.txt")))


def test_empty_corpus_names_the_source(make_cfg, write_jsonl, tmp_path):
  path = write_jsonl(["", "  ", "\n"])
  with pytest.raises(ValueError, match=rf"empty corpus: data\.source='jsonl' at data\.path='{path}'"):
    load_tokenizer(make_cfg(source="jsonl", path=path))
  (tmp_path / "blank.txt").write_text("\n\n")
  with pytest.raises(ValueError, match=r"empty corpus: data\.source='text'"):
    sources.load_documents(make_cfg(source="text", path=str(tmp_path / "blank.txt")))


@pytest.mark.parametrize(
  "field,value",
  [
    ("seq_len", 1),
    ("batch_size", 0),
    ("eval_fraction", 1.0),
    ("eval_fraction", -0.1),
    ("bpe_vocab_size", 100),
    ("source", "parquet"),
    ("eval_batches", -1),
  ],
)
def test_bad_config_values(make_cfg, field, value):
  cfg = make_cfg(**{field: value})
  for fn in (
    load_tokenizer,
    lambda c: make_train_iterator(c, None),
    lambda c: make_eval_batches(c, None),
    lambda c: unigram_entropy(c, None),
  ):
    with pytest.raises(ValueError, match=rf"data\.{field}={value!r}"):
      fn(cfg)


def test_batch_size_not_divisible_by_process_count(kjv):
  cfg, tok = kjv
  cfg = cfg.copy_and_resolve_references()
  cfg.batch_size = 6
  with pytest.raises(ValueError, match=r"data\.batch_size=6 is not divisible by process_count=4"):
    make_train_iterator(cfg, tok, process_index=0, process_count=4)
  with pytest.raises(ValueError, match=r"process_index=2, process_count=2"):
    make_train_iterator(cfg, tok, process_index=2, process_count=2)


def test_bad_tokenizer_path(make_cfg, tmp_path):
  missing = str(tmp_path / "tokenizer.json")
  with pytest.raises(FileNotFoundError, match=rf"data\.tokenizer='{missing}'"):
    load_tokenizer(make_cfg(tokenizer=missing))
  (tmp_path / "broken.json").write_text('{"not": "a tokenizer"}')
  with pytest.raises(ValueError, match=r"data\.tokenizer='.*broken\.json' is not a valid tokenizer\.json"):
    load_tokenizer(make_cfg(tokenizer=str(tmp_path / "broken.json")))


def test_tokenizer_larger_than_model(kjv):
  _, tok = kjv
  with pytest.raises(ValueError, match=r"tokenizer vocab_size=512 .* model\.vocab_size=256"):
    check_vocab(tok, 256)


def test_jsonl_missing_field_and_single_document_split(make_cfg, write_jsonl, tmp_path):
  path = write_jsonl(["one", "two"], field="body")
  with pytest.raises(ValueError, match=r"data\.jsonl_field='text': .*corpus\.jsonl:1 has no such field"):
    sources.load_documents(make_cfg(source="jsonl", path=path))
  (tmp_path / "one.txt").write_text("a single document")
  with pytest.raises(ValueError, match=r"data\.eval_fraction=0\.02: the corpus has 1 document"):
    load_tokenizer(make_cfg(source="text", path=str(tmp_path / "one.txt")))
