"""Host batches for the train step: the backend's host plans, a process's rows of each batch,
the plans' digests that every process compares, global arrays from host rows, and the
background thread that builds the next batches (``Prefetcher``)."""

from __future__ import annotations

import queue
import threading
import time
import zlib

import jax
import numpy as np

from distca_jax import attention as attn_lib
from distca_jax import metrics as metrics_lib
from distca_jax import sharding as shard_lib
from distca_jax.errors import UserError

EXTRA_PREFIX = attn_lib.EXTRA_PREFIX  # batch keys holding a backend's host-made arrays


rows_sharding = shard_lib.rows_sharding  # every batch array: rows per the rules table


def add_host_plan(np_batch: dict, backend: attn_lib.Backend, doclens, tokens_per_row: int) -> dict:
  """Runs the backend's host work (if any): rearranging the batch's tokens (`host_arrange`, the
  `cp` and `wlb` baselines) or adding plan arrays (`host_prepare`)."""
  if backend.host_arrange is not None:
    return backend.host_arrange(np_batch, doclens)
  if backend.host_prepare is None:
    return np_batch
  extra = backend.host_prepare(doclens, tokens_per_row)
  return {**np_batch, **{EXTRA_PREFIX + k: v for k, v in extra.items()}}


def local_row_ranges(mesh, rows: int) -> list[tuple[int, int]]:
  """The row ranges [a, b) of a [rows, ...] batch that this process's devices hold (rows over
  `data`), contiguous ranges merged, in order; one process owning every device gets [(0, rows)]."""
  index = rows_sharding(mesh).addressable_devices_indices_map((rows,))
  spans = sorted({(s.start or 0, rows if s.stop is None else s.stop) for (s,) in index.values()})
  merged: list[tuple[int, int]] = []
  for a, b in spans:
    if merged and a <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
    else:
      merged.append((a, b))
  return merged


# A process's part of a batch: blocks (a, b, {key: array [b - a, ...]}) holding rows [a, b).
LocalBatch = list[tuple[int, int, dict]]


def local_batch(source, step: int, row_ranges, backend: attn_lib.Backend | None, doclens,
                plan_seconds: list | None = None) -> tuple[LocalBatch, int]:
  """Rows ``row_ranges`` of step ``step``'s batch with the backend's host plan rows.

  Only those rows' tokens are built. A host plan (``host_prepare``) is computed from the GLOBAL
  document lengths ``doclens`` (the same deterministic plan in every process) and cut to the same
  rows. Backends that move tokens between rows on the host (``host_arrange``: cp, wlb) arrange
  the whole batch in every process (every row's tokens are built: a row's tokens may come from
  any other row) and keep the rows of ``row_ranges``; their digest covers the arrangement (each
  arranged row's segment ids and the plan arrays). ``plan_seconds`` gets the host planning time
  appended.

  Returns:
    (the blocks, ``plan_digest`` of the document lengths and the whole plan).
  """
  rows = source.rows
  if backend is not None and backend.host_arrange is not None:
    batch = source.batch(step)
    t0 = time.perf_counter()
    batch = add_host_plan(batch, backend, doclens, source.tokens_per_row)
    if plan_seconds is not None:
      plan_seconds.append(time.perf_counter() - t0)
    arranged = {k: v for k, v in batch.items()
                if k == "segment_ids" or k.startswith(EXTRA_PREFIX)}
    blocks = [(a, b, batch if (a, b) == (0, rows) else {k: v[a:b] for k, v in batch.items()})
              for a, b in row_ranges]
    return blocks, plan_digest(doclens, arranged)
  extra = {}
  if backend is not None and backend.host_prepare is not None:
    t0 = time.perf_counter()
    extra = {EXTRA_PREFIX + k: v
             for k, v in backend.host_prepare(doclens, source.tokens_per_row).items()}
    if plan_seconds is not None:
      plan_seconds.append(time.perf_counter() - t0)
  out = []
  for a, b in row_ranges:
    block = source.batch(step) if (a, b) == (0, rows) else source.batch(step, rows=(a, b))
    out.append((a, b, {**block, **{k: v[a:b] for k, v in extra.items()}}))
  return out, plan_digest(doclens, extra)


def plan_digest(doclens, plan: dict) -> int:
  """uint32 CRC of a step's plan metadata: its document lengths and the host plan arrays (every
  process must compute the same; ``check_plans_agree`` compares them)."""
  crc = zlib.crc32(np.asarray([len(r) for r in doclens] + [x for r in doclens for x in r],
                              np.int64).tobytes())
  for k in sorted(plan):
    crc = zlib.crc32(k.encode() + np.ascontiguousarray(plan[k]).tobytes(), crc)
  return crc


def check_plans_agree(step: int, digest: int) -> None:
  """All processes compare their ``plan_digest`` of step ``step`` (one small all-gather); raises
  a `UserError` naming the step and the processes that differ (every process raises it). A no-op
  with one process."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils
  got = np.asarray(multihost_utils.process_allgather(np.uint32(digest))).reshape(-1)
  if (got != got[0]).any():
    raise UserError(
        f"step {step}: the processes computed different host plans (plan digests by process: "
        f"{[f'{int(x):08x}' for x in got]}). Every process must run the same code, config and "
        "data files; compare their config.json, data paths and package versions.")


def device_batch(np_batch: dict | LocalBatch, mesh, rows: int | None = None) -> dict:
  """Host batch -> global arrays, rows sharded over `data`; each process fills its own devices.

  ``np_batch`` is the whole batch (a dict of [B, ...] arrays) or a process's ``LocalBatch`` with
  ``rows`` = B; a device's rows must lie inside one block.
  """
  if isinstance(np_batch, dict):
    rows = len(next(iter(np_batch.values())))
    np_batch = [(0, rows, np_batch)]
  sh = rows_sharding(mesh)

  def rows_of(key, idx):
    lo, hi, _ = idx[0].indices(rows)
    for a, b, block in np_batch:
      if a <= lo and hi <= b:
        return block[key][(slice(lo - a, hi - a),) + tuple(idx[1:])]
    raise ValueError(f"rows [{lo}, {hi}) of {key!r} are not in this process's blocks "
                     f"{[(a, b) for a, b, _ in np_batch]}")

  first = np_batch[0][2]
  return {k: jax.make_array_from_callback((rows,) + first[k].shape[1:], sh,
                                          lambda idx, k=k: rows_of(k, idx))
          for k in first}


class Prefetcher:
  """Builds host batches (and their FLOP counts) for upcoming steps on a background thread.

  With ``row_ranges`` (``local_row_ranges``) each item's batch is a ``LocalBatch`` of those rows
  only (multi-process feeding); without, it is the whole batch dict.
  """

  def __init__(self, source, model_cfg, start: int, stop: int, depth: int = 2,
               backend: attn_lib.Backend | None = None, row_ranges=None):
    self._q: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = stop
    # Host seconds per batch spent in the backend's planning (`add_host_plan`), in step order:
    # benchmarks compare it with the main thread's wait in `next` (planning off the critical
    # path shows up as planning time > 0 with ~0 wait).
    self.host_plan_s: list[float] = []
    # Step -> plan_digest, with row_ranges; the train loop pops the steps it checks.
    self.plan_digests: dict[int, int] = {}

    self._closed = threading.Event()

    def put(item) -> bool:  # False once closed (the consumer is gone)
      while not self._closed.is_set():
        try:
          self._q.put(item, timeout=0.1)
          return True
        except queue.Full:
          pass
      return False

    def work():
      for step in range(start, stop):
        if self._closed.is_set():
          return
        try:
          doclens = source.doclens(step)
          if row_ranges is not None:
            batch, self.plan_digests[step] = local_batch(source, step, row_ranges, backend,
                                                         doclens, self.host_plan_s)
          else:
            batch = source.batch(step)
            if backend is not None:
              t0 = time.perf_counter()
              batch = add_host_plan(batch, backend, doclens, source.tokens_per_row)
              self.host_plan_s.append(time.perf_counter() - t0)
          item = (step, batch, doclens)
        except Exception as e:  # surfaced in the main thread, never swallowed
          put(e)
          return
        if not put(item):
          return

    self._thread = threading.Thread(target=work, daemon=True)
    self._thread.start()
    self.model_cfg = model_cfg

  def close(self) -> None:
    """Stops the worker and waits for it (it finishes the batch in hand). A Python thread still
    running when the interpreter exits is torn down inside C++ frames (XLA, NumPy), which
    aborts the process ('terminate called without an active exception')."""
    self._closed.set()
    self._thread.join()

  def next(self):
    item = self._q.get()
    if isinstance(item, Exception):
      raise item
    step, batch, doclens = item
    return step, batch, metrics_lib.step_flops(self.model_cfg, doclens), sum(map(sum, doclens))
