"""Tokenize text, JSONL or Parquet files into the dataset format of ``distca_jax.data.files``.

  python -m distca_jax.data.tokenize --output PREFIX [--tokenizer byte|hf:NAME_OR_PATH] \\
      [--split-on-blank-lines] [--text-field text] FILE...
  python -m distca_jax.data.tokenize --describe PREFIX   # writes PREFIX.meta.json of a dataset

writes ``PREFIX.tokens.npy`` (1-D int32), ``PREFIX.offsets.npy`` (1-D int64, D + 1 offsets) and
``PREFIX.meta.json`` (documents, tokens, the largest id: a run checks the model's vocabulary
against it instead of scanning the tokens, ``files.open_dataset``). Inputs, by file name:

* ``*.jsonl`` / ``*.ndjson``: one JSON object per line, its ``--text-field`` (default 'text') a
  document (blank lines are skipped; records whose text is empty are skipped and counted);
* ``*.parquet``: each row's ``--text-field`` column a document (empty ones skipped and counted),
  read a record batch at a time; needs pyarrow (``pip install pyarrow``: a test dependency only);
* anything else: a UTF-8 text file, one document, or with ``--split-on-blank-lines`` each
  paragraph (text between lines that are empty or whitespace) one. The flag also splits the
  texts of JSONL and Parquet records.

Tokenizers:

* ``byte`` (default, always available): the UTF-8 bytes, vocabulary 256; decode a document with
  ``bytes(doc.astype(np.uint8)).decode('utf-8')``.
* ``hf:NAME_OR_PATH``: a Hugging Face tokenizer (a ``tokenizer.json`` file, a folder holding one, or
  a Hub name), through the ``tokenizers`` package, or ``transformers`` if only that is installed.
  Special tokens are added as the tokenizer does by default (Llama tokenizers prepend BOS).

Input files must be UTF-8; an empty (or whitespace-only) text file, one without paragraphs, or a
JSONL / Parquet file without a non-empty text is an error naming the file (a bad JSON line, a
record without the field or with a non-string one names the line or row). Outputs are written to
temporary names and renamed at the end, so a failed run leaves no half-written dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Callable, Iterator, Sequence, TextIO

import numpy as np

from distca_jax.data.batch import DataError
from distca_jax.data.files import dataset_paths, meta_path, write_meta

Encoder = Callable[[str], np.ndarray]
_COPY_CHUNK = 1 << 24


def byte_encode(text: str) -> np.ndarray:
  """UTF-8 bytes of ``text`` as int32 token ids in [0, 256)."""
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def byte_decode(ids: np.ndarray) -> str:
  """Inverse of ``byte_encode``."""
  return bytes(np.asarray(ids).astype(np.uint8)).decode("utf-8")


def _hf_tokenizer(name: str) -> tuple[Encoder, int]:
  try:
    import tokenizers  # pylint: disable=g-import-not-at-top
  except ImportError:
    tokenizers = None
  if tokenizers is not None:
    path = os.path.join(name, "tokenizer.json") if os.path.isdir(name) else name
    if os.path.isdir(name) and not os.path.isfile(path):
      raise DataError(f"--tokenizer hf:{name}: the folder holds no tokenizer.json; point at the "
                      "tokenizer.json file itself or at a folder that holds one")
    try:
      if os.path.isfile(path):
        tok = tokenizers.Tokenizer.from_file(path)
      else:
        tok = tokenizers.Tokenizer.from_pretrained(name)
    except Exception as e:  # the package raises many types (IO, JSON, Hub, network)
      raise DataError(f"--tokenizer hf:{name}: could not load the tokenizer ({e}); give a "
                      "tokenizer.json file, a folder holding one, or a Hub name") from e
    return (lambda text: np.asarray(tok.encode(text).ids, np.int32)), tok.get_vocab_size()
  try:
    import transformers  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise DataError(f"--tokenizer hf:{name} needs the Hugging Face tokenizers package: "
                    "pip install tokenizers (or pip install transformers), or use --tokenizer "
                    "byte") from None
  try:
    tok = transformers.AutoTokenizer.from_pretrained(name)
  except Exception as e:  # noqa: BLE001  (same reason as above)
    raise DataError(f"--tokenizer hf:{name}: could not load the tokenizer ({e})") from e
  return (lambda text: np.asarray(tok(text)["input_ids"], np.int32)), len(tok)


def get_tokenizer(spec: str) -> tuple[Encoder, int]:
  """(encode: text -> int32 ids, vocabulary size) of a tokenizer spec ('byte' or 'hf:NAME')."""
  if spec == "byte":
    return byte_encode, 256
  if spec.startswith("hf:") and len(spec) > 3:
    return _hf_tokenizer(spec[3:])
  raise DataError(f"unknown --tokenizer {spec!r}; choose 'byte' or 'hf:NAME_OR_PATH'")


_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n(?:[ \t\r\f\v]*\n)*")


JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIX = ".parquet"


def _paragraphs(text: str) -> list[str]:
  docs = [p.strip("\r\n") for p in _BLANK_LINES.split("\n" + text + "\n")]
  return [p for p in docs if p.strip()]


def read_documents(path: str, split_on_blank_lines: bool = False) -> list[str]:
  """The documents of one text file: the whole file, or its blank-line-separated paragraphs.

  Paragraphs lose the blank lines between them (and leading/trailing newlines), nothing else.
  """
  if not os.path.isfile(path):
    raise DataError(f"{path}: input file not found (or not a regular file)")
  with open(path, "rb") as f:
    raw = f.read()
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: not valid UTF-8 at byte {e.start} ({e.reason}); convert it, e.g. "
                    f"iconv -f LATIN1 -t UTF-8 {path}") from None
  if not text.strip():
    raise DataError(f"{path}: the file is empty (or only whitespace); remove it from the inputs")
  if not split_on_blank_lines:
    return [text]
  return _paragraphs(text)


def _record_text(value, where: str, field: str) -> str:
  if not isinstance(value, str):
    raise DataError(f"{where}: the record's {field!r} is {type(value).__name__}, not a string; "
                    "name the text column with --text-field")
  return value


def _jsonl_texts(path: str, field: str) -> Iterator[str]:
  with open(path, "rb") as f:
    for n, raw in enumerate(f, 1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise DataError(f"{path}:{n}: not valid UTF-8 at byte {e.start} of the line") from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}:{n}: not a JSON object ({e.msg} at column {e.colno}); JSONL "
                        "needs one JSON object per line") from None
      if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{path}:{n}: the record has no {field!r} field (it has {keys}); name "
                        "the text field with --text-field")
      yield _record_text(record[field], f"{path}:{n}", field)


def _parquet_texts(path: str, field: str) -> Iterator[str]:
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise DataError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
  try:
    f = pq.ParquetFile(path)
  except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
    raise DataError(f"{path}: not a readable Parquet file ({' '.join(str(e).split())[:200]})") from e
  names = f.schema_arrow.names
  if field not in names:
    raise DataError(f"{path}: no column {field!r} (columns: {names}); name the text column with "
                    "--text-field")
  row = 0
  for batch in f.iter_batches(columns=[field]):
    for value in batch.column(0).to_pylist():
      row += 1
      if value is None:
        value = ""
      yield _record_text(value, f"{path} row {row}", field)


def iter_documents(path: str, split_on_blank_lines: bool = False, text_field: str = "text",
                   skipped: list | None = None) -> Iterator[str]:
  """The documents of one input file by its name (module docstring): JSONL records, Parquet
  rows or a text file (``read_documents``). Empty JSONL / Parquet texts are skipped and counted
  in ``skipped`` (a one-element list); a file that yields no document raises."""
  if not os.path.isfile(path):
    raise DataError(f"{path}: input file not found (or not a regular file)")
  lower = path.lower()
  if lower.endswith(JSONL_SUFFIXES):
    texts = _jsonl_texts(path, text_field)
  elif lower.endswith(PARQUET_SUFFIX):
    texts = _parquet_texts(path, text_field)
  else:
    yield from read_documents(path, split_on_blank_lines)
    return
  found = 0
  for text in texts:
    docs = _paragraphs(text) if split_on_blank_lines else ([text] if text.strip() else [])
    if not docs and skipped is not None:
      skipped[0] += 1
    for doc in docs:
      found += 1
      yield doc
  if not found:
    raise DataError(f"{path}: no record has a non-empty {text_field!r}; check --text-field or "
                    "remove the file from the inputs")


def tokenize_files(paths: Sequence[str], output: str, *, tokenizer: str = "byte",
                   split_on_blank_lines: bool = False, text_field: str = "text",
                   log: TextIO | None = sys.stdout) -> dict:
  """Tokenize ``paths`` into ``output``.tokens.npy / .offsets.npy / .meta.json.

  Args:
    paths: text files (one document each, or one per paragraph), JSONL or Parquet files (one
      document per record: ``iter_documents``).
    output: the dataset prefix to write.
    tokenizer: 'byte' or 'hf:NAME_OR_PATH'.
    split_on_blank_lines: one document per blank-line-separated paragraph.
    text_field: the JSONL field / Parquet column holding the text.
    log: progress lines go here (None: silent).

  Returns:
    {'documents', 'tokens', 'vocab_size', 'max_id', 'tokens_path', 'offsets_path'}.
  """
  if not paths:
    raise DataError("no input files given; pass one or more text files")
  for suffix in (".tokens.npy", ".offsets.npy"):
    if output.endswith(suffix):
      raise DataError(f"--output {output!r} is a prefix; drop {suffix!r}")
  encode, vocab_size = get_tokenizer(tokenizer)
  for p in paths:  # fail on a missing input before spending time on the others
    if not os.path.isfile(p):
      raise DataError(f"{p}: input file not found (or not a regular file)")
  tokens_path, offsets_path = dataset_paths(output)
  out_dir = os.path.dirname(os.path.abspath(tokens_path))
  os.makedirs(out_dir, exist_ok=True)
  raw_path = tokens_path + ".partial.raw"
  doc_lens: list[int] = []
  total, max_id, min_id = 0, -1, None
  try:
    with open(raw_path, "wb") as raw:
      for i, path in enumerate(paths):
        file_tokens, file_docs, skipped = 0, 0, [0]
        for doc in iter_documents(path, split_on_blank_lines, text_field, skipped):
          file_docs += 1
          ids = np.asarray(encode(doc), np.int32)
          if ids.size == 0:
            raise DataError(f"{path}: a document tokenized to zero tokens with --tokenizer "
                            f"{tokenizer}; remove it or use another tokenizer")
          raw.write(ids.tobytes())
          doc_lens.append(int(ids.size))
          file_tokens += int(ids.size)
          max_id = max(max_id, int(ids.max()))
          min_id = int(ids.min()) if min_id is None else min(min_id, int(ids.min()))
        total += file_tokens
        if log is not None:
          empty = f", {skipped[0]} empty records skipped" if skipped[0] else ""
          print(f"[{i + 1}/{len(paths)}] {path}: {file_docs} docs, {file_tokens} tokens{empty} "
                f"(total {len(doc_lens)} docs, {total} tokens)", file=log, flush=True)
    offsets = np.zeros(len(doc_lens) + 1, np.int64)
    np.cumsum(doc_lens, out=offsets[1:])
    raw_tokens = np.memmap(raw_path, dtype=np.int32, mode="r", shape=(total,))
    tmp_tokens, tmp_offsets = tokens_path + ".partial.npy", offsets_path + ".partial.npy"
    out = np.lib.format.open_memmap(tmp_tokens, mode="w+", dtype=np.int32, shape=(total,))
    for lo in range(0, total, _COPY_CHUNK):
      out[lo:lo + _COPY_CHUNK] = raw_tokens[lo:lo + _COPY_CHUNK]
    out.flush()
    del out, raw_tokens
    np.save(tmp_offsets, offsets)
    if os.path.exists(meta_path(output)):  # a stale one must never describe the new files
      os.remove(meta_path(output))
    os.replace(tmp_tokens, tokens_path)
    os.replace(tmp_offsets, offsets_path)
    write_meta(output, documents=len(doc_lens), tokens=total, max_id=max_id, min_id=min_id,
               tokenizer=tokenizer, vocab_size=vocab_size)
  finally:
    for p in (raw_path, tokens_path + ".partial.npy", offsets_path + ".partial.npy"):
      if os.path.exists(p):
        os.remove(p)
  if log is not None:
    print(f"wrote {tokens_path} and {offsets_path}: {len(doc_lens)} documents, {total} tokens; "
          f"tokenizer vocabulary {vocab_size}, largest id {max_id} (use a model vocab_size > "
          f"{max_id})", file=log, flush=True)
  return {"documents": len(doc_lens), "tokens": total, "vocab_size": vocab_size, "max_id": max_id,
          "tokens_path": tokens_path, "offsets_path": offsets_path}


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m distca_jax.data.tokenize",
      description="Tokenize text files into PREFIX.tokens.npy + PREFIX.offsets.npy.")
  parser.add_argument("--output", help="dataset prefix to write")
  parser.add_argument("--describe", metavar="PREFIX",
                      help="write PREFIX.meta.json of an existing dataset (one pass over its "
                           "tokens) and exit: processes that open it then skip that pass")
  parser.add_argument("--text-field", default="text",
                      help="JSONL field / Parquet column holding the text (default: text)")
  parser.add_argument("--tokenizer", default="byte",
                      help="'byte' (UTF-8 bytes, vocab 256) or 'hf:NAME_OR_PATH'")
  parser.add_argument("--split-on-blank-lines", action="store_true",
                      help="one document per blank-line-separated paragraph (default: per file)")
  parser.add_argument("files", nargs="*", metavar="FILE",
                      help="UTF-8 text files, *.jsonl / *.ndjson, *.parquet")
  args = parser.parse_args(argv)
  try:
    if args.describe:
      from distca_jax.data.files import describe_dataset  # pylint: disable=g-import-not-at-top
      meta = describe_dataset(args.describe)
      print(f"wrote {meta_path(args.describe)}: {meta}")
      return 0
    if not args.output:
      raise DataError("--output PREFIX is required (or --describe PREFIX)")
    tokenize_files(args.files, args.output, tokenizer=args.tokenizer,
                   split_on_blank_lines=args.split_on_blank_lines, text_field=args.text_field)
  except DataError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
