"""The exchange's row copy on a side CUDA stream, hidden behind independent compute (one GPU).

``side_copy_start(x, routes, recv_rows, blocks)`` -> ``(y, token)`` and
``side_copy_done(y, x, routes, token)`` -> ``y`` are an XLA FFI pair (CUDA C++ in
``custom_ops/side_stream/side_copy.cu``). The copy's contract (``side_copy_reference``): routes
are one device's exchange routes (int32 ``[6, S]``, ``distca_jax.plan.ROUTE_ROWS``) read from
the receiver's side, every group ``g`` of ``x [Cs, ...]`` at ``peer_send_off[g]`` with
``recv_len[g]`` rows lands at ``recv_off[g]`` of ``y [recv_rows, ...]``; rows no group fills are
zero, and so are rows whose group points outside ``x`` (the first group covering a row decides).
On one GPU these are the exchange's self routes: every group is a local row move.

How: start records an event on XLA's stream, makes the device's side stream (created once per
device, highest priority) wait on it, and launches the copy there with a grid of ``blocks`` CTAs
of 1024 threads (the SM budget), then returns; XLA's stream runs the work scheduled after start
while the copy runs. done makes XLA's stream wait on the copy's completion event. With
``on_side=False`` the same kernel runs on XLA's stream (the serialized path, for comparison).

Order: XLA sees start and done as two ordinary custom calls; nothing in the data flow keeps
other work between them, so its scheduler may put done right after start (no overlap).
``overlapped`` ties them around the compute with ``lax.optimization_barrier``: start's token
goes through one barrier with the compute's inputs (the compute cannot begin before start), and
the compute's outputs go through another with ``y``, ``x``, routes and the token (done cannot
run before the compute has been enqueued). A barrier is an identity XLA never moves values
across, so the order holds in the scheduled program (tests/test_side_stream.py checks it).

Lifetime: the copy reads ``x`` and ``routes`` and writes ``y`` while XLA's stream moves on. All
three are done's operands (``y`` aliased to its output), so XLA keeps their buffers allocated
until done and lets no other value take them before (other ops may read ``x``); the event
recorded at start orders the copy after every earlier use of those buffers on XLA's stream, and
done orders every later use after the copy. Nothing but done may read ``y`` before done
(``overlapped`` and the tests hand ``y`` only to done). Each call's events sit in a slot of a
ring of 64 per device, found by done through the token buffer's address (start writes the
slot's index into the token): at most 64 calls per device in flight (started, not yet done);
start refuses a 65th, done refuses a token that no start in flight produced.

Both calls are side-effecting for XLA: it never merges two starts of equal operands (a
rematerialized forward's start and the original's would share one token) nor drops one.

Not differentiable (the one-GPU proof of the overlap; the data plane's exchange keeps its own
VJP). CPU: ``side_copy_cpu.cc`` implements the same pair synchronously (the copy at start) and
keeps the same books of calls in flight, so the same program (calls, aliasing, order, refusals)
runs on fake CPU devices. Build both libraries with ``bash custom_ops/side_stream/build.sh``
(into ``build/side_stream``; ``DISTCA_SIDE_STREAM_DIR`` names another directory).
"""

from __future__ import annotations

import ctypes
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from custom_ops import KernelUnavailableError

START = "distca_side_copy_start"
START_INTO = "distca_side_copy_start_into"
DONE = "distca_side_copy_done"
MAX_GROUPS = 4096  # side_copy.h kMaxGroups
MAX_IN_FLIGHT = 64  # side_copy.cu kSlots
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBS = {  # platform -> (library file, {target: symbol})
    "cuda": ("libside_copy_cuda.so", {START: "DistcaSideCopyStart",
                                      START_INTO: "DistcaSideCopyStartInto",
                                      DONE: "DistcaSideCopyDone"}),
    "cpu": ("libside_copy_cpu.so", {START: "DistcaSideCopyStartCpu",
                                    START_INTO: "DistcaSideCopyStartIntoCpu",
                                    DONE: "DistcaSideCopyDoneCpu"}),
}
_registered: set[str] = set()


def library_dir() -> str:
  """Where the libraries are loaded from: ``DISTCA_SIDE_STREAM_DIR`` or ``build/side_stream``
  under the repository root."""
  return os.environ.get("DISTCA_SIDE_STREAM_DIR") or os.path.join(ROOT, "build", "side_stream")


def register(platform: str) -> None:
  """Loads the library of ``platform`` ('cuda' or 'cpu') and registers its FFI targets once."""
  if platform in _registered:
    return
  if platform not in _LIBS:
    raise ValueError(f"side_copy platform={platform!r}; choose one of {sorted(_LIBS)}")
  name, symbols = _LIBS[platform]
  path = os.path.join(library_dir(), name)
  if not os.path.exists(path):
    raise KernelUnavailableError(
        f"side_copy needs {path}: run `bash custom_ops/side_stream/build.sh` from the repository "
        "root (or set DISTCA_SIDE_STREAM_DIR to a directory holding it)")
  lib = ctypes.cdll.LoadLibrary(path)
  plat = "CUDA" if platform == "cuda" else "cpu"
  for target, symbol in symbols.items():
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform=plat)
  _registered.add(platform)


def _platform() -> str:
  backend = jax.default_backend()
  return "cuda" if backend in ("gpu", "cuda") else backend


def check_args(x, routes, recv_rows: int, blocks: int) -> None:
  """One-line errors for inputs the kernel cannot take (shapes and attributes, at trace time)."""
  if x.ndim < 1:
    raise ValueError(f"side_copy x of shape {x.shape} needs a leading row axis")
  if routes.dtype != jnp.int32 or routes.ndim != 2 or routes.shape[0] != 6 or not (
      1 <= routes.shape[1] <= MAX_GROUPS):
    raise ValueError(f"side_copy routes {routes.dtype}{list(routes.shape)}: pass one device's "
                     f"int32 [6, S] routes (plan.ROUTE_ROWS), 1 <= S <= {MAX_GROUPS}")
  row_bytes = int(np.prod(x.shape[1:], dtype=np.int64)) * jnp.dtype(x.dtype).itemsize
  if row_bytes % 16:
    raise ValueError(f"side_copy rows of {row_bytes} bytes (x {x.dtype}{list(x.shape)}): the "
                     "copy moves 16-byte vectors; pad rows to a multiple of 16 bytes")
  if not isinstance(recv_rows, (int, np.integer)) or recv_rows < 0:
    raise ValueError(f"side_copy recv_rows={recv_rows!r} must be an integer >= 0")
  if not isinstance(blocks, (int, np.integer)) or not 1 <= blocks <= 65535:
    raise ValueError(f"side_copy blocks={blocks!r} (the copy's CTAs, its SM budget) must be an "
                     "integer in [1, 65535]")


def side_copy_start(x, routes, recv_rows: int, blocks: int, on_side: bool = True, into=None):
  """Starts the copy (module docstring): ``(y [recv_rows, ...], token int32[])``. ``y`` is
  complete only after ``side_copy_done``; hand it to nothing else before. ``into``: a
  ``[recv_rows, ...]`` buffer of x's dtype that becomes ``y`` (aliased; e.g. filled with a
  poison value, to check that the copy writes every row)."""
  check_args(x, routes, recv_rows, blocks)
  register(_platform())
  out = (jax.ShapeDtypeStruct((int(recv_rows),) + x.shape[1:], x.dtype),
         jax.ShapeDtypeStruct((), jnp.int32))
  attrs = dict(blocks=np.int64(blocks), on_side=np.int64(bool(on_side)))
  if into is None:
    return jax.ffi.ffi_call(START, out, has_side_effect=True)(x, routes, **attrs)
  if (into.shape, into.dtype) != (out[0].shape, out[0].dtype):
    raise ValueError(f"side_copy into {into.dtype}{list(into.shape)}: pass a buffer of "
                     f"{out[0].dtype}{list(out[0].shape)} (recv_rows rows like x's)")
  return jax.ffi.ffi_call(START_INTO, out, input_output_aliases={2: 0},
                          has_side_effect=True)(x, routes, into, **attrs)


def side_copy_done(y, x, routes, token):
  """Makes XLA's stream wait for the copy that produced ``y`` and ``token`` (start's outputs,
  unchanged); returns ``y`` (aliased: no copy)."""
  register(_platform())
  return jax.ffi.ffi_call(DONE, jax.ShapeDtypeStruct(y.shape, y.dtype),
                          input_output_aliases={0: 0}, has_side_effect=True)(y, x, routes, token)


def overlapped(x, routes, recv_rows: int, blocks: int, compute, *args, order: str = "overlap",
               on_side: bool = True, into=None):
  """``(copy of x by routes, compute(*args))`` with the copy started before the compute and
  done after it (``order='overlap'``), or done before the compute begins (``order='serial'``:
  the copy, then the compute, as on one stream). The barriers fix the order (module docstring).
  ``on_side`` and ``into``: as in ``side_copy_start``."""
  (y,), out = overlapped_copies([(x, routes, recv_rows, into)], blocks, compute, *args,
                                order=order, on_side=on_side)
  return y, out


def overlapped_copies(copies, blocks: int, compute, *args, order: str = "overlap",
                      on_side: bool = True):
  """``overlapped`` for several copies in flight at once: ``copies`` holds ``(x, routes,
  recv_rows, into)`` tuples (``into`` may be None); returns ``(tuple of y, compute(*args))``.
  On the side stream the copies run one after another, in order, beside the compute."""
  if order not in ("overlap", "serial"):
    raise ValueError(f"side_copy order={order!r}; choose 'overlap' or 'serial'")
  started = []
  for x, routes, recv_rows, into in copies:
    y, token = side_copy_start(x, routes, recv_rows, blocks, on_side=on_side, into=into)
    started.append((y, x, routes, token))
  if order == "serial":
    ys = tuple(side_copy_done(*c) for c in started)
    ys, args = lax.optimization_barrier((ys, args))
    return ys, compute(*args)
  tokens = tuple(c[3] for c in started)
  tokens, args = lax.optimization_barrier((tokens, args))  # compute after every start
  out = compute(*args)
  started = [c[:3] + (t,) for c, t in zip(started, tokens)]
  started, out = lax.optimization_barrier((started, out))  # every done after the compute
  return tuple(side_copy_done(*c) for c in started), out


def side_copy_reference(x, routes, recv_rows: int):
  """The copy's contract in plain jnp (module docstring)."""
  rows = jnp.arange(recv_rows, dtype=jnp.int32)
  src = jnp.full((recv_rows,), x.shape[0], jnp.int32)  # x.shape[0]: a zero row
  for g in reversed(range(routes.shape[1])):  # the first covering group decides
    off, n, at = routes[2, g], routes[3, g], routes[5, g]
    mine = (rows >= off) & (rows < off + n)
    s = at + rows - off
    src = jnp.where(mine, jnp.where((s >= 0) & (s < x.shape[0]), s, x.shape[0]), src)
  return jnp.take(x, src, axis=0, mode="fill", fill_value=0)


def random_routes(rng: np.random.Generator, x_rows: int, recv_rows: int, groups: int,
                  sizes=None, fill: float = 0.9) -> np.ndarray:
  """Self routes ``[6, S]`` for one device (host, NumPy): ``groups`` groups whose sizes are
  ``sizes`` (or drawn at random) scaled to ``fill`` of ``min(x_rows, recv_rows)``, packed from
  row 0 in ``x`` in group order and in ``y`` in a random order of the groups, so that the copy
  moves every group; rows past the groups stay unfilled."""
  cap = min(x_rows, recv_rows)
  w = rng.random(groups) + 0.05 if sizes is None else np.asarray(sizes, np.float64)
  n = np.floor(w / w.sum() * fill * cap).astype(np.int64)
  send_off = np.concatenate([[0], np.cumsum(n)[:-1]])
  perm = rng.permutation(groups)
  recv_off = np.zeros(groups, np.int64)
  recv_off[perm] = np.concatenate([[0], np.cumsum(n[perm])[:-1]])
  return np.stack([send_off, n, recv_off, n, recv_off, send_off]).astype(np.int32)


_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-, %]+)\}?")


def _computations(hlo_text: str):
  """``({name: [instruction lines in printed order]}, entry name)`` of an HLO module's text."""
  comps: dict[str, list[str]] = {}
  entry, name = None, None
  for line in hlo_text.splitlines():
    m = _COMP.match(line)
    if m and "=" not in line.split("(")[0]:
      name = m.group(1)
      comps[name] = []
      if line.startswith("ENTRY"):
        entry = name
    elif name is not None and line.strip() and line.strip() != "}":
      comps[name].append(line)
  if entry is None:
    raise ValueError("schedule_order: no ENTRY computation in this HLO text")
  return comps, entry


def _kinds(comps):
  """A function of an instruction line: 'start', 'done', 'dot' (a dot, a cuBLAS call, or any
  instruction calling a computation that holds one) or None."""
  memo: dict[str, bool] = {}

  def has_dot(comp: str) -> bool:
    if comp not in memo:
      memo[comp] = False
      memo[comp] = any(is_dot(l) for l in comps.get(comp, []))
    return memo[comp]

  def is_dot(line: str) -> bool:
    if " dot(" in line or "cublas" in line:
      return True
    return any(has_dot(c.strip().lstrip("%")) for m in _CALLS.finditer(line)
               for c in m.group(1).split(","))

  def kind(line: str):
    if f'custom_call_target="{START}"' in line or f'custom_call_target="{START_INTO}"' in line:
      return "start"
    if f'custom_call_target="{DONE}"' in line:
      return "done"
    return "dot" if is_dot(line) else None
  return kind


def schedule_order(hlo_text: str) -> list[str]:
  """The entry computation of a compiled, scheduled HLO module (``compiled.as_text()``) as the
  sequence of its instructions that are the copy's start ('start', with or without ``into``),
  its done ('done') or a matrix product ('dot': a dot, a cuBLAS call, or any instruction calling
  a computation that holds one, e.g. a fusion or a command buffer); the others are left out. XLA
  prints a scheduled computation's instructions in their schedule order."""
  comps, entry = _computations(hlo_text)
  kind = _kinds(comps)
  return [k for k in map(kind, comps[entry]) if k is not None]


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ")
_OPCODE = re.compile(r" ([a-z][\w\-]*)\(")


def _instruction(line: str):
  """``(name, opcode, operand names, get-tuple-element index or None)`` of an HLO line."""
  m = _INSTR.match(line)
  if not m:
    return None
  o = _OPCODE.search(line, m.end() - 1)
  if not o:
    return None
  depth, i = 1, o.end()
  while depth and i < len(line):
    depth += {"(": 1, ")": -1}.get(line[i], 0)
    i += 1
  operands = re.findall(r"%([\w.\-]+)", line[o.end():i - 1])
  k = re.search(r"index=(\d+)", line[i:])
  return m.group(1), o.group(1), operands, int(k.group(1)) if k else None


def schedule_spans(hlo_text: str) -> list[tuple[str, str, list[str]]]:
  """Every copy of a compiled, scheduled HLO module, in every computation (a loop's body
  included): ``(start's op_name, done's op_name, [op_name of each matrix product scheduled
  between them])``. A done is paired with the start whose token it takes (followed back through
  tuples, barriers and bitcasts)."""
  comps, _ = _computations(hlo_text)
  kind = _kinds(comps)
  spans = []
  for lines in comps.values():
    info, starts, order = {}, {}, []
    for pos, line in enumerate(lines):
      ins = _instruction(line)
      if ins is None:
        continue
      info[ins[0]] = ins
      m = _OP_NAME.search(line)
      order.append((pos, ins[0], kind(line), m.group(1) if m else ""))

    def source(name, path=()):  # the instruction a value comes from, through tuples
      while name in info:
        _, op, operands, index = info[name]
        if op == "get-tuple-element":
          name, path = operands[0], (index,) + path
        elif op == "tuple" and path:
          name, path = operands[path[0]], path[1:]
        elif op in ("opt-barrier", "bitcast", "copy") and operands:
          name = operands[0]
        else:
          return name
      return None

    for pos, name, k, op_name in order:
      if k == "start":
        starts[name] = (pos, op_name)
      elif k == "done":
        token = info[name][2][3]
        src = source(token)
        if src not in starts:
          raise ValueError(f"schedule_spans: done {name} takes a token from {src!r}, no start "
                           "scheduled before it in its computation")
        at, start_name = starts[src]
        dots = [o for p, _, kk, o in order if kk == "dot" and at < p < pos]
        spans.append((start_name, op_name, dots))
  return spans


def copy_overlaps_dots(hlo_text: str) -> bool:
  """Whether every start of the copy is scheduled before every matrix product of the entry
  computation and every done after them all (``schedule_order``)."""
  order = schedule_order(hlo_text)
  if "dot" not in order or "start" not in order or "done" not in order:
    return False
  first, last = order.index("dot"), len(order) - 1 - order[::-1].index("dot")
  return (max(i for i, k in enumerate(order) if k == "start") < first
          and min(i for i, k in enumerate(order) if k == "done") > last)
