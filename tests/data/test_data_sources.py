"""Each source reads exactly the documents written to it; the embedded corpus is the whole KJV Bible; the
held-out split is disjoint, of the asked size, and a function of the texts alone."""

import json

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from glm_jax.data import sources


def test_jsonl_reads_the_named_field_and_drops_empty_documents(make_cfg, write_jsonl, tmp_path):
  docs = ["first doc", "", "  \n", "third \"quoted\" doc\nwith two lines", "ünïcödé ✓"]
  path = write_jsonl(docs, field="body")
  got = sources.load_documents(make_cfg(source="jsonl", path=path, jsonl_field="body"))
  assert got == [docs[0], docs[3], docs[4]]
  # Two files through a glob, in sorted order; blank lines are skipped.
  (tmp_path / "b.jsonl").write_text(json.dumps({"text": "from b"}) + "\n\n")
  (tmp_path / "a.jsonl").write_text(json.dumps({"text": "from a"}) + "\n")
  assert sources.load_documents(make_cfg(source="jsonl", path=str(tmp_path / "[ab].jsonl"))) == ["from a", "from b"]


def test_text_one_document_per_file_from_a_directory(make_cfg, tmp_path):
  root = tmp_path / "corpus"
  (root / "sub").mkdir(parents=True)
  (root / "b.txt").write_text("bee\n")
  (root / "a.txt").write_text("ay\n\nstill ay\n")
  (root / "sub" / "c.md").write_text("sea")
  (root / ".hidden").write_text("never read")
  (root / "empty.txt").write_text("\n \n")
  got = sources.load_documents(make_cfg(source="text", path=str(root)))
  assert got == ["ay\n\nstill ay\n", "bee\n", "sea"]  # sorted by path: a.txt, b.txt, (empty dropped), sub/c.md
  assert sources.load_documents(make_cfg(source="text", path=str(root / "*.txt"))) == ["ay\n\nstill ay\n", "bee\n"]


def test_text_one_document_per_paragraph(make_cfg, tmp_path):
  path = tmp_path / "book.txt"
  path.write_text("Para one.\n\nPara two,\nline two.\n\n\n  \nPara three.\n")
  got = sources.load_documents(make_cfg(source="text", path=str(path), text_document="paragraph"))
  assert got == ["Para one.", "Para two,\nline two.", "Para three."]


def test_arrayrecord_records_are_utf8_documents(make_cfg, tmp_path):
  docs = ["In the beginning.", "", "Ἐν ἀρχῇ ἦν ὁ λόγος", "line one\nline two"]
  for name, part in (("part-0.array_record", docs[:2]), ("part-1.array_record", docs[2:])):
    writer = ArrayRecordWriter(str(tmp_path / name), "group_size:1")
    for d in part:
      writer.write(d.encode("utf-8"))
    writer.close()
  got = sources.load_documents(make_cfg(source="arrayrecord", path=str(tmp_path / "*.array_record")))
  assert got == [docs[0], docs[2], docs[3]]


def test_embedded_corpus_is_the_kjv_bible_one_document_per_chapter():
  docs = sources.embedded_documents()
  assert len(docs) == 1189  # the chapters of the 66 books of the Protestant canon
  assert len({d.split("\n", 1)[0].rsplit(" ", 1)[0] for d in docs}) == 66
  assert docs[0].startswith("Genesis 1\n1:1 In the beginning God created the heaven")
  assert docs[0].split("\n")[-2].startswith("1:31 And God saw every thing that he had made")
  assert docs[-1].startswith("Revelation 22\n22:1 ")
  assert "Amen" in docs[-1].split("\n")[-2]
  assert 4_000_000 < sum(map(len, docs)) < 4_600_000


def test_split_is_disjoint_sized_and_depends_on_texts_only():
  docs = [f"document number {i}" for i in range(500)]
  hashes = sources.document_hashes(docs)
  train, held = sources.split_documents(hashes, 0.05)
  assert len(held) == 25 and len(train) == 475
  assert set(train).isdisjoint(held) and set(train) | set(held) == set(range(500))
  np.testing.assert_array_equal(sources.split_documents(sources.document_hashes(docs), 0.05)[1], held)
  # Reversing the corpus holds out the same texts.
  rev = docs[::-1]
  _, held_rev = sources.split_documents(sources.document_hashes(rev), 0.05)
  assert {rev[i] for i in held_rev} == {docs[i] for i in held}
  # At least one document is held out, and at least one kept, whatever the fraction.
  three = sources.document_hashes(["a", "b", "c"])
  assert [len(s) for s in sources.split_documents(three, 0.001)] == [2, 1]
  assert [len(s) for s in sources.split_documents(three, 0.99)] == [1, 2]
  assert [len(s) for s in sources.split_documents(three, 0.0)] == [3, 0]
