"""The tokenizer's JSONL and Parquet inputs, the dataset description (PREFIX.meta.json) that
spares each process the pass over every token, and a process reading only its own rows."""

import json
import sys

import numpy as np
import pytest

from distca_jax import data
from distca_jax.data import files, tokenize
from distca_jax.data.tokenize import byte_decode


def _docs(prefix):
  tokens, offsets = np.load(prefix + ".tokens.npy"), np.load(prefix + ".offsets.npy")
  return [byte_decode(tokens[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]


def test_jsonl_records_are_documents(tmp_path):
  path = tmp_path / "a.jsonl"
  records = [{"text": "first doc", "id": 1}, {"text": ""}, {"text": "zweites \u00fcber\n\nthird"}]
  path.write_text("\n".join(json.dumps(r) for r in records[:2]) + "\n\n" + json.dumps(records[2])
                  + "\n")
  prefix = str(tmp_path / "ds")
  out = tokenize.tokenize_files([str(path)], prefix, log=None)
  assert _docs(prefix) == ["first doc", "zweites \u00fcber\n\nthird"]
  assert out["documents"] == 2
  tokenize.tokenize_files([str(path)], prefix, split_on_blank_lines=True, log=None)
  assert _docs(prefix) == ["first doc", "zweites \u00fcber", "third"]
  other = tmp_path / "b.ndjson"
  other.write_text(json.dumps({"body": "x y"}) + "\n")
  tokenize.tokenize_files([str(other)], prefix, text_field="body", log=None)
  assert _docs(prefix) == ["x y"]


@pytest.mark.parametrize("content,match", [
    ('{"text": "ok"}\n{"text": \n', r"b.jsonl:2: not a JSON object"),
    ('{"text": "ok"}\n{"body": "x"}\n', r"b.jsonl:2: the record has no 'text' field \(it has "
                                        r"\['body'\]\); name the text field with --text-field"),
    ('[1, 2]\n', r"b.jsonl:1: the record has no 'text' field \(it has list\)"),
    ('{"text": 3}\n', r"b.jsonl:1: the record's 'text' is int, not a string"),
    ('{"text": ""}\n\n', r"b.jsonl: no record has a non-empty 'text'"),
])
def test_jsonl_errors_name_the_line(tmp_path, content, match):
  path = tmp_path / "b.jsonl"
  path.write_text(content)
  with pytest.raises(data.DataError, match=match):
    tokenize.tokenize_files([str(path)], str(tmp_path / "ds"), log=None)
  assert not (tmp_path / "ds.tokens.npy").exists()


def test_parquet_rows_are_documents(tmp_path):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  path = str(tmp_path / "c.parquet")
  pq.write_table(pa.table({"text": ["one", None, "", "two three"], "n": [1, 2, 3, 4]}), path,
                 row_group_size=2)
  prefix = str(tmp_path / "ds")
  tokenize.tokenize_files([path], prefix, log=None)
  assert _docs(prefix) == ["one", "two three"]
  with pytest.raises(data.DataError, match=r"no column 'body' \(columns: \['text', 'n'\]\)"):
    tokenize.tokenize_files([path], prefix, text_field="body", log=None)
  with pytest.raises(data.DataError, match=r"row 1: the record's 'n' is int, not a string"):
    tokenize.tokenize_files([path], prefix, text_field="n", log=None)


def test_parquet_without_pyarrow_is_one_line(tmp_path, monkeypatch):
  path = tmp_path / "c.parquet"
  path.write_bytes(b"PAR1")
  monkeypatch.setitem(sys.modules, "pyarrow", None)
  monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
  with pytest.raises(data.DataError) as e:
    tokenize.tokenize_files([str(path)], str(tmp_path / "ds"), log=None)
  assert str(e.value) == f"{path}: reading Parquet needs pyarrow: pip install pyarrow"


def _text_dataset(tmp_path, texts):
  paths = []
  for i, t in enumerate(texts):
    p = tmp_path / f"t{i}.txt"
    p.write_text(t)
    paths.append(str(p))
  prefix = str(tmp_path / "ds")
  tokenize.tokenize_files(paths, prefix, log=None)
  return prefix


def test_description_replaces_the_pass_over_every_token(tmp_path, monkeypatch):
  """The tokenizer writes PREFIX.meta.json; opening with it reads no token for the id check; an
  id outside the vocabulary is still an error (from the description); a description of other
  files is an error; --describe writes one for a dataset made elsewhere."""
  prefix = _text_dataset(tmp_path, ["hello world", "abc"])
  meta = json.loads(open(prefix + ".meta.json").read())
  assert (meta["documents"], meta["tokens"], meta["max_id"]) == (2, 14, ord("w"))

  def no_scan(*a, **k):
    raise AssertionError("scanned every token despite PREFIX.meta.json")

  monkeypatch.setattr(files, "_check_token_range", no_scan)
  data.FileSource(prefix, rows=1, tokens_per_row=4, vocab_size=256, seed=0)
  with pytest.raises(data.DataError, match=r"token ids span \[32, 119\] .*outside \[0, "
                                           r"vocab_size=100\)"):
    data.FileSource(prefix, rows=1, tokens_per_row=4, vocab_size=100, seed=0)
  monkeypatch.undo()
  np.save(prefix + ".offsets.npy", np.array([0, 11], np.int64))
  np.save(prefix + ".tokens.npy", np.load(prefix + ".tokens.npy")[:11])
  with pytest.raises(data.DataError, match=r"describes 2 documents and 14 tokens but the files "
                                           r"hold 1 and 11; .* --describe"):
    data.FileSource(prefix, rows=1, tokens_per_row=4, vocab_size=256, seed=0)
  assert tokenize.main(["--describe", prefix]) == 0
  meta = json.loads(open(prefix + ".meta.json").read())
  assert (meta["documents"], meta["tokens"], meta["min_id"], meta["max_id"]) == (
      1, 11, ord(" "), ord("w"))
  data.FileSource(prefix, rows=1, tokens_per_row=4, vocab_size=256, seed=0)


class _Recorder:
  """A token array that records the positions read."""

  def __init__(self, tokens):
    self.tokens, self.read = tokens, set()

  def __getitem__(self, idx):
    self.read.update(np.asarray(idx).reshape(-1).tolist())
    return self.tokens[idx]


def test_a_process_reads_only_the_tokens_of_its_rows(tmp_path, seed):
  """batch(step, rows=(a, b)), what each process of a job builds: the rows equal the whole
  batch's, and the tokens read are those rows' (at most T + 1 per row), not the step's."""
  rng = np.random.default_rng(seed)
  prefix = _text_dataset(tmp_path, ["".join(chr(97 + x) for x in rng.integers(0, 26, n))
                                    for n in rng.integers(5, 60, 40)])
  rows, t = 8, 32
  src = data.FileSource(prefix, rows=rows, tokens_per_row=t, vocab_size=256, seed=seed)
  for step in range(3):
    whole = src.batch(step)
    src.tokens = _Recorder(src.tokens)
    part = src.batch(step, rows=(2, 4))
    read, src.tokens = src.tokens.read, src.tokens.tokens
    for k in whole:
      np.testing.assert_array_equal(part[k], whole[k][2:4])
    assert 0 < len(read) <= 2 * (t + 1), (step, len(read))


@pytest.mark.parametrize("fmt", ["json", "npy", "txt"])
def test_a_users_document_lengths_are_a_workload(tmp_path, seed, fmt):
  """A document-length file of one's own data (JSON list, .npy or one length a line) is a
  workload: its lengths are the pool as given (unscaled), rows are packed from them, and the
  synthetic source, the simulator and e2e_bench take its path."""
  import json
  from distca_jax.data import make_source
  from distca_jax.data import workloads as wl
  rng = np.random.default_rng(seed)
  lens = rng.integers(1, 900, size=200)
  path = tmp_path / f"lens.{fmt}"
  if fmt == "json":
    path.write_text(json.dumps(lens.tolist()))
  elif fmt == "npy":
    np.save(path, lens)
  else:
    path.write_text("\n".join(map(str, lens)) + "\n")
  np.testing.assert_array_equal(wl.document_pool(str(path), 4096, 0), lens)
  rows = wl.WorkloadSampler(str(path), 512, seed=1).step_doclens(0, 4)
  assert len(rows) == 4 and all(sum(r) == 512 for r in rows), rows
  flat = [x for r in rows for x in r]
  assert max(flat) < 900 and set(flat) - set(lens.tolist()) <= set(range(1, 513))  # cut pieces
  src = make_source({"source": "synthetic", "workload": str(path)}, rows=4, tokens_per_row=512,
                    vocab_size=64, seed=1)
  assert src.doclens(0) == rows  # the sampler of the same seed
  assert src.batch(0)["inputs"].shape == (4, 512)


def test_a_bad_document_length_file_is_one_line(tmp_path):
  from distca_jax.data import workloads as wl
  with pytest.raises(data.DataError, match=r"unknown workload='nope': choose one of \['pretrain', "
                     r"'prolong'\], or give the path of a document-length file"):
    wl.check_workload("nope")
  bad = tmp_path / "bad.txt"
  bad.write_text("12\n-3\n")
  with pytest.raises(data.DataError, match=r"bad.txt: expected a non-empty list of positive integers"):
    wl.load_doclens(str(bad))
  from experiments import simulate
  with pytest.raises(SystemExit):
    simulate.parse_args(["--workload", str(tmp_path / "missing.json")])


@pytest.mark.slow
def test_simulate_and_e2e_bench_take_a_document_length_file(tmp_path):
  import json
  from experiments import e2e_bench, simulate
  path = tmp_path / "lens.json"
  path.write_text(json.dumps([3000, 700, 120, 9000, 50, 2048] * 20))
  out = tmp_path / "sim.json"
  simulate.main(["--gpus", "8", "--tensor", "2", "--tokens", "16384", "--batches", "1",
                 "--workload", str(path), "--json", str(out)])
  assert json.loads(out.read_text())["workload"] == str(path)
  e2e = str(tmp_path / "e2e")
  e2e_bench.main(["--tiny", "--backends", "distca", "--workloads", str(path), "--tokens", "256",
                  "--layers", "1", "--steps", "1", "--warmup", "1", "--out", e2e])
  res = json.load(open(e2e + ".json"))["results"]
  assert res and all("error" not in r for r in res), res
