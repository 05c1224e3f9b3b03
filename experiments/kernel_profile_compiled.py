"""Kernel profile, our kernel's side: the launch configuration of the Pallas core-attention
kernels and a tile model of the work they execute (`pallas_launch`), and the Triton IR / PTX facts
of an XLA dump of them (`read_xla_dump`: MMA and copy instructions, shared memory, warps)."""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
from typing import Any, Iterable, Sequence


# ------------------------------------------------------------------------------------------------
# Our kernels: launch configuration and tile model
# ------------------------------------------------------------------------------------------------


def pallas_launch(cu_q: Sequence[int], cu_k: Sequence[int], q_rows: int, kv_rows: int,
                  num_heads: int, num_kv_heads: int, head_dim: int, bs) -> dict:
  """Launch configuration and executed work of our three kernels on one task table.

  Uses the kernel's own block tables and loop bounds (``query_block_table`` /
  ``key_block_table`` / ``key_loop_bounds`` / ``query_window_bounds``), so the counts are the
  tiles the kernels visit: a forward / dq tile is one (query block, key block) step of a
  program's loop, a dkdv tile one (key block, query window) step for one query head of the GQA
  group.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from custom_ops import varlen_attention as va  # pylint: disable=import-outside-toplevel

  cu_q_N1 = jnp.asarray(cu_q, jnp.int32)
  cu_k_N1 = jnp.asarray(cu_k, jnp.int32)
  num_tasks = len(cu_q) - 1
  dpad = va.pl.next_power_of_2(int(head_dim))  # the kernel's padded D (_cols)
  group = num_heads // num_kv_heads

  # The kernel's own table builders (its planning code, called here as the kernel calls it).
  query_block_table, key_block_table = va.query_block_table, va.key_block_table
  key_loop_bounds = va.key_loop_bounds
  query_window_bounds = va.query_window_bounds  # the dkdv loop's query window

  # One jit per table: the tables are jnp code meant for inside jit; eagerly every op would
  # compile on its own.
  @functools.partial(jax.jit, static_argnums=(2, 3))
  def query_tables(cu_q_N1, cu_k_N1, block_q, block_k):
    meta = query_block_table(cu_q_N1, cu_k_N1, q_rows, block_q)
    n_full, n_blocks = key_loop_bounds(meta[1], meta[3], meta[4], block_k)
    return meta, n_full, n_blocks

  def query_kernel(block_q, block_k, warps, stages, matmuls):
    meta, n_full, n_blocks = query_tables(cu_q_N1, cu_k_N1, block_q, block_k)
    n_full, n_blocks = (np.asarray(x, np.int64) for x in (n_full, n_blocks))
    tiles = num_heads * int(n_blocks.sum())
    return dict(grid=[num_heads, int(meta.shape[1])], programs=num_heads * int(meta.shape[1]),
                programs_with_work=num_heads * int((n_blocks > 0).sum()),
                rows_per_program=block_q, loop_step_rows=block_k, num_warps=warps,
                threads=32 * warps, num_stages=stages, tiles=tiles,
                masked_tiles=num_heads * int((n_blocks - n_full).sum()),
                matmuls_per_tile=matmuls,
                executed_flops=float(tiles * matmuls * 2 * block_q * block_k * dpad))

  out = dict(
      block_sizes=dataclasses.asdict(bs), head_dim_padded=dpad, tasks=num_tasks,
      kernels=dict(
          varlen_attention_fwd=dict(role="fwd", **query_kernel(
              bs.block_q, bs.block_k, bs.num_warps, bs.num_stages, 2)),
          varlen_attention_dq=dict(role="dq", **query_kernel(
              bs.block_q_dq, bs.block_k_dq, bs.num_warps_dq, bs.num_stages_dq, 3))))
  @functools.partial(jax.jit, static_argnums=(2, 3))
  def key_tables(cu_q_N1, cu_k_N1, block_k, block_q):
    meta = key_block_table(cu_q_N1, cu_k_N1, kv_rows, block_k)
    _, n_windows, n_masked = query_window_bounds(meta[3], meta[1], meta[4], block_q, block_k)
    return meta, n_windows, n_masked

  meta, n_windows, n_masked = key_tables(cu_q_N1, cu_k_N1, bs.block_k_dkv, bs.block_q_dkv)
  n_windows, n_masked = (np.asarray(x, np.int64) for x in (n_windows, n_masked))
  tiles = num_heads * int(n_windows.sum())  # grid over KV heads, a loop over the group's heads
  out["kernels"]["varlen_attention_dkv"] = dict(
      role="dkdv", grid=[num_kv_heads, int(meta.shape[1])],
      programs=num_kv_heads * int(meta.shape[1]),
      programs_with_work=num_kv_heads * int((n_windows > 0).sum()),
      rows_per_program=bs.block_k_dkv, loop_step_rows=bs.block_q_dkv, heads_per_program=group,
      num_warps=bs.num_warps_dkv, threads=32 * bs.num_warps_dkv, num_stages=bs.num_stages_dkv,
      tiles=tiles, masked_tiles=num_heads * int(n_masked.sum()), matmuls_per_tile=4,
      executed_flops=float(tiles * 4 * 2 * bs.block_k_dkv * bs.block_q_dkv * dpad))
  return out


# ------------------------------------------------------------------------------------------------
# Triton IR / PTX facts from an XLA dump (pure parsers + the dump reader)
# ------------------------------------------------------------------------------------------------
PTX_PATTERNS = {
    "wgmma": r"\bwgmma\.mma_async",          # Hopper warpgroup MMA
    "mma_sync": r"\bmma\.sync\.",             # Ampere-style warp MMA
    "tma": r"\bcp\.async\.bulk\.tensor",      # TMA copies
    "cp_async": r"\bcp\.async\.c[ag]\.",      # Ampere async global->shared copies
    # Local memory in PTX means stack arrays; register spills appear only after ptxas (SASS).
    "ld_local": r"\bld\.local\.",
    "st_local": r"\bst\.local\.",
}
_PTX_RES = {k: re.compile(v) for k, v in PTX_PATTERNS.items()}
_PTX_ENTRY_RE = re.compile(r"\.entry\s+([\w$.]+)\s*\(")


def ptx_entry_stats(ptx: str) -> dict[str, dict]:
  """Per kernel entry of a PTX module: instruction counts (PTX_PATTERNS) and .maxntid / .reqntid."""
  out = {}
  starts = [(m.start(), m.group(1)) for m in _PTX_ENTRY_RE.finditer(ptx)]
  for i, (pos, name) in enumerate(starts):
    body = ptx[pos: starts[i + 1][0] if i + 1 < len(starts) else len(ptx)]
    stats = {k: len(r.findall(body)) for k, r in _PTX_RES.items()}
    m = re.search(r"\.(?:maxntid|reqntid)\s+(\d+)", body)
    stats["threads"] = int(m.group(1)) if m else None
    out[name] = stats
  return out


_TTG_SHARED_RE = re.compile(r"(?:ttg|triton_gpu)\.shared\s*=\s*(\d+)")
_TTG_WARPS_RE = re.compile(r"\"(?:ttg|triton_gpu)\.num-warps\"\s*=\s*(\d+)")
_MMA_VERSION_RE = re.compile(r"versionMajor\s*=\s*(\d+)")


def triton_pass_log_stats(lines: Iterable[str]) -> dict:
  """Facts from a Triton pass log (XLA's <module>.<kernel>.triton-passes.log): of the last IR dump
  still at the Triton-GPU level (has ``tt.func``), the shared memory Triton allocated, the MMA
  layouts' versions, and the dot ops left (``ttng.warp_group_dot``: wgmma; ``tt.dot``: not)."""
  best: dict | None = None
  cur: dict | None = None

  def finish(section):
    nonlocal best
    if section is not None and section["tt_func"]:
      best = section

  for line in lines:
    if line.startswith("// -----// IR Dump"):
      finish(cur)
      cur = dict(pass_name=line.strip("/- \n").replace("IR Dump ", ""), tt_func=False,
                 shared_bytes=None, num_warps=None, mma_versions=set(), warp_group_dots=0,
                 tt_dots=0, async_copies=0, tma_copies=0)
      continue
    if cur is None:
      continue
    if "tt.func" in line:
      cur["tt_func"] = True
    m = _TTG_SHARED_RE.search(line)
    if m:
      cur["shared_bytes"] = int(m.group(1))
    m = _TTG_WARPS_RE.search(line)
    if m:
      cur["num_warps"] = int(m.group(1))
    if "versionMajor" in line:  # an MMA layout: #ttg.nvidia_mma<{versionMajor = 3, ...}>
      cur["mma_versions"].update(int(v) for v in _MMA_VERSION_RE.findall(line))
    if re.search(r"ttng\.warp_group_dot\b(?!_wait)", line):
      cur["warp_group_dots"] += 1
    if re.search(r"\btt\.dot\b", line):
      cur["tt_dots"] += 1
    if "async_copy_global_to_local" in line:
      cur["async_copies"] += 1
    if "async_tma_copy" in line or "descriptor_load" in line:
      cur["tma_copies"] += 1
  finish(cur)
  if best is None:
    return {}
  best["mma_versions"] = sorted(best["mma_versions"])
  del best["tt_func"]
  return best


def read_xla_dump(dump_dir: str, kernel_names: Sequence[str]) -> dict:
  """PTX entry stats and Triton pass-log facts of ``kernel_names`` from an XLA dump folder."""
  def find(pattern):  # XLA writes some dumps into per-module subfolders
    return sorted(glob.glob(os.path.join(dump_dir, "**", pattern), recursive=True))

  out: dict[str, Any] = {"files": [os.path.relpath(p, dump_dir) for p in find("*")][:20]}
  ptx_paths = find("*.ptx")
  entries: dict[str, dict] = {}
  for path in ptx_paths:
    with open(path, errors="replace") as f:
      entries.update(ptx_entry_stats(f.read()))
  kernels = {}
  for kernel in kernel_names:
    found = {name: s for name, s in entries.items() if name.startswith(kernel)}
    logs = find(f"*{kernel}*.triton-passes.log")
    ir = {}
    if logs:
      with open(logs[0], errors="replace") as f:
        ir = triton_pass_log_stats(f)
    kernels[kernel] = dict(ptx=found or None, triton_ir=ir or None,
                           ptx_entries=sorted(found), pass_logs=[os.path.basename(p)
                                                                 for p in logs])
  out["kernels"] = kernels
  out["ptx_files"] = len(ptx_paths)
  if not ptx_paths:
    out["note"] = ("XLA wrote no *.ptx for the probe module: is the module regex right, or did "
                   "a compilation cache skip compilation?")
  return out
