"""Tests of distca_jax.data: batch contract, split rule, determinism, files, tokenizer, errors.

Expected batches come from a slot-by-slot reference written from the contract's words (walk the
stream token by token), independent of the vectorized code under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pytest

from distca_jax import data
from distca_jax.data import batch as batch_lib
from distca_jax.data import files as files_lib
from distca_jax.data import tokenize as tok_lib
from distca_jax.data import workloads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------
def _reference(ident, tokens, rows, T):
  """The contract, slot by slot, for one step's window of a stream.

  Args:
    ident: document identity of stream tokens [start, start + rows * T + 1) (one look-ahead).
    tokens: their token ids, or None to skip inputs/targets.
    rows, T: batch shape.
  """
  n = rows * T
  out = {k: np.zeros((rows, T), dt) for k, dt in batch_lib.BATCH_DTYPES.items()}
  seg = pos = 0
  for p in range(n):
    r, c = divmod(p, T)
    if c == 0 or ident[p] != ident[p - 1]:
      seg = 1 if c == 0 else seg + 1
      pos = 0
    else:
      pos += 1
    same = ident[p + 1] == ident[p]
    out["segment_ids"][r, c] = seg
    out["positions"][r, c] = pos
    out["loss_mask"][r, c] = 1.0 if same else 0.0
    if tokens is not None:
      out["inputs"][r, c] = tokens[p]
      out["targets"][r, c] = tokens[p + 1] if same else 0
  return out


def _stream_ident(lens_for_epoch, start, count):
  """Identity (epoch * 10**7 + index in epoch order) of stream tokens [start, start + count)."""
  parts, epoch, have = [], 0, 0
  while have < start + count:
    lens = lens_for_epoch(epoch)
    parts.append(epoch * 10**7 + np.repeat(np.arange(lens.size), lens))
    have += int(lens.sum())
    epoch += 1
  return np.concatenate(parts)[start:start + count]


def _naive_stream_doclens(pool, seed, start, length):
  """The original (pre-vectorization) WorkloadSampler.stream_doclens loop, kept as an oracle."""
  total, out, pos, end = int(pool.sum()), [], start, start + length
  while pos < end:
    epoch, off = divmod(pos, total)
    lens = pool[np.random.default_rng([seed, 1, epoch]).permutation(pool.size)]
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    i = int(np.searchsorted(starts, off, side="right")) - 1
    while pos < end and i < lens.size:
      n = int(min(starts[i] + lens[i], off + (end - pos)) - off)
      out.append(n)
      pos, off, i = pos + n, off + n, i + 1
  return out


def _write(tmp_path, tokens, offsets, name="ds"):
  prefix = str(tmp_path / name)
  np.save(prefix + ".tokens.npy", tokens)
  np.save(prefix + ".offsets.npy", offsets)
  return prefix


def _write_docs(tmp_path, docs, name="ds"):
  lens = [len(d) for d in docs]
  return _write(tmp_path, np.concatenate(docs).astype(np.int32),
                np.concatenate([[0], np.cumsum(lens)]).astype(np.int64), name)


def _random_docs(rng, n_docs, max_len, vocab):
  return [rng.integers(0, vocab, size=int(rng.integers(1, max_len + 1))).astype(np.int32)
          for _ in range(n_docs)]


def _assert_batches_equal(a, b, keys=batch_lib.BATCH_KEYS):
  for k in keys:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _doclens_from_segments(b):
  out = []
  for seg in b["segment_ids"]:
    ids = seg[seg > 0]
    out.append(np.bincount(ids)[1:].tolist() if ids.size else [])
  return out


# ---------------------------------------------------------------------------------------------
# Synthetic workloads
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("workload", ["pretrain", "prolong"])
def test_synthetic_contract(workload):
  rows, T, V, seed = 4, 512, 97, 7
  src = data.SyntheticSource(workload, rows=rows, tokens_per_row=T, vocab_size=V, seed=seed)
  assert isinstance(src, data.Source)
  pool = src.sampler.pool
  order = lambda e: pool[np.random.default_rng([seed, 1, e]).permutation(pool.size)]
  n = rows * T
  for step in (0, 3, int(pool.sum()) // n):  # the last one straddles the epoch boundary
    b, nxt = src.batch(step), src.batch(step + 1)
    data.validate_batch(b, rows=rows, tokens_per_row=T, vocab_size=V)
    ident = _stream_ident(order, step * n, n + 1)
    ref = _reference(ident, None, rows, T)
    _assert_batches_equal(b, ref, ("segment_ids", "positions", "loss_mask"))
    assert src.doclens(step) == _doclens_from_segments(b)
    assert src.doclens(step) == src.sampler.step_doclens(step, rows)
    # Targets are the next stream token (across rows and into the next step) where loss is 1.
    stream = np.concatenate([b["inputs"].reshape(-1), nxt["inputs"][:1, :1].reshape(-1)])
    loss = b["loss_mask"].reshape(-1) == 1
    np.testing.assert_array_equal(b["targets"].reshape(-1)[loss], stream[1:][loss])
    # Learnable content: inside each document the tokens step by one stride in [1, 4] mod V.
    diffs = (stream[1:] - stream[:-1]) % V
    same = ident[1:] == ident[:-1]
    for doc in np.unique(ident[:-1]):
      d = diffs[same & (ident[:-1] == doc)]
      if d.size:
        assert (d == d[0]).all() and 1 <= d[0] <= 4, (doc, d)
  assert len(np.unique(b["inputs"])) > V // 2  # random starts cover the vocabulary


def test_workload_stream_matches_original_loop():
  sampler = workloads.WorkloadSampler("prolong", 1024, seed=3)
  n = 8 * 1024
  for start in (0, 5 * n, sampler.pool_tokens - n // 2, 2 * sampler.pool_tokens + 17):
    assert sampler.stream_doclens(start, n) == _naive_stream_doclens(sampler.pool, 3, start, n)


def test_split_into_rows_matches_loop():
  rng = np.random.default_rng(0)
  for _ in range(200):
    flat = rng.integers(1, 60, size=int(rng.integers(0, 12))).tolist()
    T = int(rng.integers(1, 40))
    rows = -(-sum(flat) // T) + int(rng.integers(0, 2))
    expect, r, room = [[] for _ in range(rows)], 0, T
    for length in flat:  # the rule in words: fill rows in order, cut at each boundary
      while length:
        take = min(length, room)
        expect[r].append(take)
        length, room = length - take, room - take
        if room == 0:
          r, room = r + 1, T
    assert workloads.split_into_rows(flat, T, rows) == expect
  with pytest.raises(data.DataError, match="more than"):
    workloads.split_into_rows([10, 10], 8, 2)
  with pytest.raises(data.DataError, match="must be positive"):
    workloads.split_into_rows([3, 0], 8, 2)


def test_synthetic_speed_128k():
  src = data.SyntheticSource("pretrain", rows=8, tokens_per_row=131072, vocab_size=128256, seed=0)
  src.batch(0)  # builds the epoch order once
  times = []
  for step in (1, 2):
    t = time.perf_counter()
    b = src.batch(step)
    times.append(time.perf_counter() - t)
  assert b["inputs"].shape == (8, 131072)
  assert min(times) < 1.0, times


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------
def test_files_contract_file_order(tmp_path):
  rng = np.random.default_rng(1)
  V, rows, T = 1000, 3, 64
  docs = _random_docs(rng, 23, 150, V)  # some longer than T: split over rows and steps
  prefix = _write_docs(tmp_path, docs)
  src = data.FileSource(prefix, rows=rows, tokens_per_row=T, vocab_size=V, seed=0, shuffle=False)
  n, total = rows * T, sum(len(d) for d in docs)
  stream = np.concatenate(docs * 4)
  lens = np.array([len(d) for d in docs])
  for step in range(0, 2 * total // n + 2):  # two epochs and their seams
    ident = _stream_ident(lambda e: lens, step * n, n + 1)
    ref = _reference(ident, stream[step * n:step * n + n + 1], rows, T)
    b = src.batch(step)
    _assert_batches_equal(b, ref)
    data.validate_batch(b, rows=rows, tokens_per_row=T, vocab_size=V)
    assert src.doclens(step) == _doclens_from_segments(b)


def test_files_shuffle_is_a_permutation_per_epoch(tmp_path):
  rng = np.random.default_rng(2)
  docs = _random_docs(rng, 40, 50, 500)
  prefix = _write_docs(tmp_path, docs)
  rows, T = 2, 32
  src = data.FileSource(prefix, rows=rows, tokens_per_row=T, vocab_size=500, seed=5, shuffle=True)
  total, n = sum(len(d) for d in docs), rows * T
  steps = -(-2 * total // n) + 1
  inputs = np.concatenate([src.batch(s)["inputs"].reshape(-1) for s in range(steps)])
  loss = np.concatenate([src.batch(s)["loss_mask"].reshape(-1) for s in range(steps)])

  def epoch_docs(lo, hi):
    ends = lo + np.flatnonzero(loss[lo:hi] == 0) + 1
    return [inputs[a:b].tolist() for a, b in zip(np.concatenate([[lo], ends[:-1]]), ends)]

  file_order = [d.tolist() for d in docs]
  e0, e1 = epoch_docs(0, total), epoch_docs(total, 2 * total)
  assert sorted(e0) == sorted(file_order) and sorted(e1) == sorted(file_order)
  assert e0 != file_order and e1 != e0


def test_split_rule_long_document(tmp_path):
  T, rows = 16, 3
  a = np.arange(100, 140, dtype=np.int32)  # 40 tokens = 2.5 rows
  bdoc = np.arange(7, 12, dtype=np.int32)  # 5 tokens
  prefix = _write_docs(tmp_path, [a, bdoc])
  src = data.FileSource(prefix, rows=rows, tokens_per_row=T, vocab_size=200, seed=0, shuffle=False)
  b = src.batch(0)
  assert src.doclens(0) == [[16], [16], [8, 5, 3]]
  np.testing.assert_array_equal(b["inputs"][0], a[:16])
  np.testing.assert_array_equal(b["inputs"][1], a[16:32])
  np.testing.assert_array_equal(b["inputs"][2], np.concatenate([a[32:], bdoc, a[:3]]))
  # Each piece is a document of its own: segment ids and positions restart.
  np.testing.assert_array_equal(b["positions"][0], np.arange(16))
  np.testing.assert_array_equal(b["positions"][1], np.arange(16))
  np.testing.assert_array_equal(b["positions"][2],
                                np.concatenate([np.arange(8), np.arange(5), np.arange(3)]))
  np.testing.assert_array_equal(b["segment_ids"][2], [1] * 8 + [2] * 5 + [3] * 3)
  # ...but the loss follows the document: a split piece's last target is its next token.
  np.testing.assert_array_equal(b["targets"][0], a[1:17])
  assert b["loss_mask"][0].all() and b["loss_mask"][1].all()
  np.testing.assert_array_equal(b["loss_mask"][2],
                                [1] * 7 + [0] + [1] * 4 + [0] + [1] * 3)
  np.testing.assert_array_equal(b["targets"][2][[7, 12]], [0, 0])
  assert b["targets"][2, 15] == a[3]  # the document goes on into the next step
  assert src.batch(1)["inputs"][0, 0] == a[3] and src.batch(1)["positions"][0, 0] == 0


def test_pack_documents_padding():
  docs = [np.arange(1, 6), np.arange(20, 40), np.arange(50, 53)]
  b, doclens = data.pack_documents(docs, rows=3, tokens_per_row=16)
  assert doclens == [[5, 11], [9, 3], []]
  ident = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)] + [[-1]])
  ref = _reference(np.concatenate([ident[:-1], np.full(48 - 28 + 1, -1)]), None, 3, 16)
  data.validate_batch(b, rows=3, tokens_per_row=16, vocab_size=60)
  real = b["segment_ids"] > 0
  assert real.sum() == 28 and not real[1, 12:].any() and not real[2].any()
  for k in ("loss_mask", "positions"):
    np.testing.assert_array_equal(b[k][real], ref[k][real], err_msg=k)
  for k in batch_lib.BATCH_KEYS:
    assert (b[k][~real] == 0).all(), k
  np.testing.assert_array_equal(b["inputs"][real], np.concatenate(docs))
  assert b["targets"][0, 15] == 31 and b["loss_mask"][0, 15] == 1  # doc 1 goes on in row 1
  seg, pos = data.layout_arrays(doclens, 16)
  np.testing.assert_array_equal(seg, b["segment_ids"])
  np.testing.assert_array_equal(pos, b["positions"])
  with pytest.raises(data.DataError, match="row 1"):
    data.layout_arrays([[16], [10, 7]], 16)
  with pytest.raises(data.DataError, match="more than"):
    data.pack_documents(docs, rows=1, tokens_per_row=16)
  with pytest.raises(data.DataError, match="document 1 is empty"):
    data.pack_documents([[1], []], rows=1, tokens_per_row=16)


@pytest.mark.parametrize("corrupt, match", [
    (lambda b: b["loss_mask"].__setitem__((1, 15), 1.0), "padding"),
    (lambda b: b["positions"].__setitem__((0, 3), 7), "positions"),
    (lambda b: b["targets"].__setitem__((0, 1), 9), "next input"),
    (lambda b: b["segment_ids"].__setitem__((0, 6), 3), "segment_ids"),
    (lambda b: b.__setitem__("inputs", b["inputs"].astype(np.int64)), "int32"),
    (lambda b: b["inputs"].__setitem__((0, 0), 99), "outside"),
])
def test_validate_batch_catches(corrupt, match):
  b, _ = data.pack_documents([np.arange(1, 6), np.arange(20, 40)], rows=2, tokens_per_row=16)
  data.validate_batch(b, vocab_size=60)
  corrupt(b)
  with pytest.raises(data.DataError, match=match):
    data.validate_batch(b, vocab_size=60)


# ---------------------------------------------------------------------------------------------
# Determinism and resumption
# ---------------------------------------------------------------------------------------------
def _sources(tmp_path, seed):
  rng = np.random.default_rng(3)
  prefix = _write_docs(tmp_path, _random_docs(rng, 30, 200, 300))
  cfgs = [dict(source="synthetic", workload="pretrain", context_length=0),
          dict(source="synthetic", workload="prolong", context_length=4096),
          dict(source="files", path=prefix, shuffle=True)]
  return [data.make_source(ml_collections.ConfigDict(c), rows=4, tokens_per_row=256,
                           vocab_size=300, seed=seed) for c in cfgs]


def test_batch_is_a_pure_function_of_step(tmp_path):
  fresh = [s.batch(5) for s in _sources(tmp_path, seed=11)]
  for src, expect in zip(_sources(tmp_path, seed=11), fresh):
    for s in range(5):
      src.batch(s)
    _assert_batches_equal(src.batch(5), expect)
    for far in (10**4, 10**6, 3):  # other epochs evict cached orders; the result must not change
      src.batch(far)
    _assert_batches_equal(src.batch(5), expect)
    assert src.doclens(5) == _doclens_from_segments(expect)
  for src, expect in zip(_sources(tmp_path, seed=12), fresh):
    assert not np.array_equal(src.batch(5)["inputs"], expect["inputs"]), src.describe()


def test_make_source_config_and_errors(tmp_path):
  syn = data.make_source(dict(source="synthetic", workload="prolong"), rows=2,
                         tokens_per_row=128, vocab_size=50, seed=0)
  assert syn.rows == 2 and syn.tokens_per_row == 128 and syn.vocab_size == 50
  assert syn.context_length == 128 and "prolong" in syn.describe()
  big = data.make_source(dict(source="synthetic", workload="prolong", context_length=524288),
                         rows=1, tokens_per_row=128, vocab_size=50, seed=0)
  assert big.context_length == 524288 and big.sampler.pool.max() > 128
  cases = [
      (dict(source="webdataset"), "source='webdataset'.*'synthetic', 'files'"),
      (dict(source="synthetic", workload="chat"), "workload='chat'.*'pretrain', 'prolong'"),
      (dict(source="synthetic", workload="pretrain", context_length=-1), "context_length=-1"),
      (dict(source="files"), "lacks the key 'path'"),
      (dict(source="files", path=""), "path=''"),
      (dict(workload="pretrain"), "lacks the key 'source'"),
      (dict(source="files", path=str(tmp_path / "nope")), "nope.tokens.npy: tokens file not found"),
  ]
  for cfg, match in cases:
    with pytest.raises(data.DataError, match=match):
      data.make_source(ml_collections.ConfigDict(cfg), rows=1, tokens_per_row=8, vocab_size=10,
                       seed=0)
  with pytest.raises(data.DataError, match="step=-1"):
    syn.batch(-1)


# ---------------------------------------------------------------------------------------------
# File validation: every documented error names the file and the problem
# ---------------------------------------------------------------------------------------------
_GOOD_TOKENS = np.array([1, 2, 3, 4, 5, 6], np.int32)
_GOOD_OFFSETS = np.array([0, 2, 6], np.int64)


@pytest.mark.parametrize("tokens, offsets, bad_file, match", [
    (_GOOD_TOKENS.astype(np.int64), _GOOD_OFFSETS, "tokens", "1-D int32.*int64"),
    (_GOOD_TOKENS.reshape(2, 3), _GOOD_OFFSETS, "tokens", r"1-D int32.*\(2, 3\)"),
    (_GOOD_TOKENS, _GOOD_OFFSETS.astype(np.int32), "offsets", "1-D int64.*int32"),
    (_GOOD_TOKENS, _GOOD_OFFSETS.astype(np.float64), "offsets", "1-D int64.*float64"),
    (_GOOD_TOKENS, np.array([1, 2, 6]), "offsets", r"start at 0.*offsets\[0\]=1"),
    (_GOOD_TOKENS, np.array([0, 4, 2, 6]), "offsets", r"increase.*offsets\[1\]=4 > offsets\[2\]=2"),
    (_GOOD_TOKENS, np.array([0, 2, 5]), "offsets",
     r"last offset.*offsets\[-1\]=5.*len\(tokens\)=6"),
    (np.zeros(0, np.int32), np.array([0]), "tokens", "dataset is empty"),
    (np.zeros(0, np.int32), np.array([0, 0]), "tokens", "dataset is empty"),
    (_GOOD_TOKENS, np.array([0, 2, 2, 6, 6]), "offsets", "2 empty documents.*document 1"),
    (np.array([1, 2, 3, 10, 5, 6], np.int32), _GOOD_OFFSETS, "tokens",
     r"token id 10 at position 3 \(document 1\) is outside \[0, vocab_size=10\)"),
    (np.array([1, -2, 3, 4, 5, 6], np.int32), _GOOD_OFFSETS, "tokens",
     r"token id -2 at position 1 \(document 0\)"),
])
def test_file_validation_errors(tmp_path, tokens, offsets, bad_file, match):
  prefix = _write(tmp_path, tokens, np.asarray(offsets))
  with pytest.raises(data.DataError, match=match) as e:
    data.FileSource(prefix, rows=1, tokens_per_row=4, vocab_size=10, seed=0)
  assert f"{prefix}.{bad_file}.npy" in str(e.value)
  assert isinstance(e.value, ValueError)


def test_file_missing_and_unreadable(tmp_path):
  prefix = _write(tmp_path, _GOOD_TOKENS, _GOOD_OFFSETS)
  data.FileSource(prefix, rows=1, tokens_per_row=4, vocab_size=10, seed=0)  # the good one opens
  with pytest.raises(data.DataError, match=r"drop '\.tokens\.npy'"):
    data.FileSource(prefix + ".tokens.npy", rows=1, tokens_per_row=4, vocab_size=10, seed=0)
  os.remove(prefix + ".offsets.npy")
  with pytest.raises(data.DataError, match=f"{prefix}.offsets.npy: offsets file not found"):
    data.FileSource(prefix, rows=1, tokens_per_row=4, vocab_size=10, seed=0)
  with open(prefix + ".offsets.npy", "w") as f:
    f.write("0 2 6\n")
  with pytest.raises(data.DataError, match=f"{prefix}.offsets.npy: not a readable NumPy"):
    data.FileSource(prefix, rows=1, tokens_per_row=4, vocab_size=10, seed=0)


# ---------------------------------------------------------------------------------------------
# Tokenizer tool
# ---------------------------------------------------------------------------------------------
def test_tokenize_round_trip(tmp_path):
  texts = {"a.txt": ("Héllo, wörld!\nSecond line of the same paragraph.\n\n\n  \n"
                     "Para 2: 漢字 🙂\n"),
           "b.txt": "one paragraph only, no trailing newline"}
  paths = []
  for name, text in texts.items():
    (tmp_path / name).write_text(text, encoding="utf-8")
    paths.append(str(tmp_path / name))
  # Paragraph mode through the command line, as users run it.
  out = str(tmp_path / "out" / "para")
  proc = subprocess.run([sys.executable, "-m", "distca_jax.data.tokenize", "--output", out,
                         "--split-on-blank-lines", *paths], cwd=ROOT, capture_output=True,
                        text=True, check=False)
  assert proc.returncode == 0, proc.stderr
  assert "[1/2]" in proc.stdout and "[2/2]" in proc.stdout and "3 docs" in proc.stdout
  tokens, offsets = data.open_dataset(out, vocab_size=256)
  got = [tok_lib.byte_decode(tokens[offsets[i]:offsets[i + 1]]) for i in range(offsets.size - 1)]
  assert got == ["Héllo, wörld!\nSecond line of the same paragraph.", "Para 2: 漢字 🙂",
                 "one paragraph only, no trailing newline"]
  # Whole-file mode keeps each file exactly; the result loads as a source.
  stats = tok_lib.tokenize_files(paths, str(tmp_path / "whole"), log=None)
  assert stats["documents"] == 2 and stats["max_id"] < 256
  src = data.FileSource(str(tmp_path / "whole"), rows=1, tokens_per_row=8, vocab_size=256, seed=0,
                        shuffle=False)
  got = [tok_lib.byte_decode(src.tokens[src.offsets[i]:src.offsets[i + 1]]) for i in range(2)]
  assert got == list(texts.values())
  assert not [p for p in os.listdir(tmp_path) if "partial" in p]


def test_tokenize_errors(tmp_path):
  good = tmp_path / "good.txt"
  good.write_text("fine\n")
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  blank = tmp_path / "blank.txt"
  blank.write_text("\n  \n\t\n")
  latin = tmp_path / "latin.txt"
  latin.write_bytes("caf\xe9".encode("latin-1"))
  out = str(tmp_path / "ds")
  cases = [
      ([good, empty], {}, f"{empty}: the file is empty"),
      ([good, blank], {"split_on_blank_lines": True}, f"{blank}: the file is empty"),
      ([good, tmp_path / "missing.txt"], {}, "missing.txt: input file not found"),
      ([latin], {}, f"{latin}: not valid UTF-8 at byte 3"),
      ([good], {"tokenizer": "sentencepiece"}, "unknown --tokenizer 'sentencepiece'"),
      ([], {}, "no input files"),
  ]
  for paths, kw, match in cases:
    with pytest.raises(data.DataError, match=match):
      tok_lib.tokenize_files([str(p) for p in paths], out, log=None, **kw)
    assert not os.path.exists(out + ".tokens.npy")
  with pytest.raises(data.DataError, match="is a prefix"):
    tok_lib.tokenize_files([str(good)], out + ".tokens.npy", log=None)
  proc = subprocess.run([sys.executable, "-m", "distca_jax.data.tokenize", "--output", out,
                         str(good), str(empty)], cwd=ROOT, capture_output=True, text=True,
                        check=False)
  assert proc.returncode == 1 and f"{empty}: the file is empty" in proc.stderr


def test_tokenize_hf_without_package(tmp_path, monkeypatch):
  # A None entry in sys.modules makes `import` fail as if the package were not installed.
  monkeypatch.setitem(sys.modules, "tokenizers", None)
  monkeypatch.setitem(sys.modules, "transformers", None)
  (tmp_path / "a.txt").write_text("hi")
  with pytest.raises(data.DataError, match="pip install tokenizers"):
    tok_lib.tokenize_files([str(tmp_path / "a.txt")], str(tmp_path / "ds"),
                           tokenizer="hf:meta-llama/Llama-3.1-8B", log=None)


def test_tokenize_hf_tokenizer_json(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  text = tmp_path / "t.txt"
  text.write_text("the quick brown fox\n\njumps over the lazy dog\n")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.train([str(text)], tokenizers.trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
  tok.save(str(tmp_path / "tokenizer.json"))
  stats = tok_lib.tokenize_files([str(text)], str(tmp_path / "ds"), tokenizer=f"hf:{tmp_path}",
                                 split_on_blank_lines=True, log=None)
  tokens, offsets = data.open_dataset(str(tmp_path / "ds"), vocab_size=stats["vocab_size"])
  expect = [tok.encode("the quick brown fox").ids, tok.encode("jumps over the lazy dog").ids]
  assert [tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(2)] == expect
