"""Process setup before any JAX computation: distributed init and the XLA/NCCL settings we need.

Flags must be in the environment before the first backend call, so `run` sets them and only then
touches devices. Settings already present in the environment are kept (the user's word wins).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import ml_collections

from distca_jax.errors import UserError
# Stop requests live in distca_jax.stop (the trainer reads them too); launch keeps their names.
from distca_jax.stop import SUPERVISED_ENV, distributed_state, newest_checkpoint

# NVLink multicast (NVLS) is kept off: it destabilized shared GPU hosts.
# No XLA overlap flags are set, by measurement: CAD's all-to-alls are async collectives that XLA
# schedules around the linear layers of the other nano-batch (`attention.nano_batches=2`,
# model.ping_pong_layers: post-CA of layer i and pre-CA of layer i+1), and on 2 H200s the step
# was within 0.6-1.1% of its signal-only twin (tiny all-to-alls), so there was little
# communication left to hide (measured with the within-layer ping-pong schedule);
# docs/design.md Sec. 13 measured `--xla_gpu_enable_latency_hiding_scheduler` hiding 37% vs 30% of
# an all-to-all. Pass any XLA flags through the environment (XLA_FLAGS) and they are kept.
# XLA_PYTHON_CLIENT_MEM_FRACTION: JAX preallocates 75% of GPU memory by default; Llama-3-8B layers
# at 128K tokens per GPU with remat 'none' plan ~105-113 GiB of an H200's 140, which fails at
# 75% and fits at 92% (NCCL and kernel workspaces live in the rest).
# XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async: CUDA's stream-ordered pool instead of XLA's BFC
# allocator. XLA allocates a step's temporaries as one block; with BFC, a buffer made while a
# step runs (after its block) splits the free memory, and the next step's block no longer fits:
# on 4 x H100 80GB, Pretrain 128K, distca needing 65.93 of 72.85 GiB ran its first step and
# failed the second allocating its 42.30 GiB block; with cuda_async it trained at 1.314x
# packed_dp, whose step time moved 3072.0 -> 3097.3 ms (results/four/README.md).
GPU_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92",
                    "XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"}
# XLA flags added to XLA_FLAGS unless it already sets them (the user's value wins):
# --xla_gpu_enable_dynamic_slice_fusion=false: in the layer scan, XLA's dynamic-slice fusion
# cloned FlashAttention-3's forward custom call so that one copy wrote O straight into the stacked
# residual, so every layer ran the forward kernel twice (two flash_mha_fwd calls in the compiled
# step's HLO, one without the flag). On one H200, 2 layers of Llama-3-8B: 2 rows of 64K steps
# 1725 -> 1646 ms (packed_dp), 64K Pretrain 809 -> 785 ms, ProLong 732 -> 720 ms.
XLA_FLAG_DEFAULTS = {"xla_gpu_enable_dynamic_slice_fusion": "false"}


def xla_flags_with_defaults(flags: str) -> str:
  """``flags`` (an XLA_FLAGS value) plus every ``XLA_FLAG_DEFAULTS`` entry it does not set."""
  out = flags.split()
  for name, value in XLA_FLAG_DEFAULTS.items():
    if not any(f.lstrip("-").split("=")[0] == name for f in out):
      out.append(f"--{name}={value}")
  return " ".join(out)


def configure_environment() -> None:
  """Sets ``GPU_ENV_DEFAULTS`` and ``XLA_FLAG_DEFAULTS`` where the environment does not; call
  before the first JAX backend call (the flags are read when the backend starts)."""
  for k, v in GPU_ENV_DEFAULTS.items():
    os.environ.setdefault(k, v)
  os.environ["XLA_FLAGS"] = xla_flags_with_defaults(os.environ.get("XLA_FLAGS", ""))


@dataclasses.dataclass(frozen=True)
class Distributed:
  """How this process joins a multi-process job (``jax.distributed.initialize`` arguments).

  ``coordinator_address``, ``num_processes`` and ``process_id`` name the job explicitly (all
  three, or none: then the cluster is detected, SLURM / Open MPI / Kubernetes). A process whose
  heartbeats stop for ``heartbeat_timeout_s`` seconds is declared lost and the others stop with
  one line naming it (`Watchdog`); ``initialization_timeout_s`` bounds the wait for every process
  to join.
  """

  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  heartbeat_timeout_s: int = 30
  initialization_timeout_s: int = 300

  @property
  def explicit(self) -> bool:
    return self.coordinator_address is not None

  def check(self) -> None:
    given = {k: getattr(self, k) for k in ("coordinator_address", "num_processes", "process_id")}
    if any(v is not None for v in given.values()) and any(v is None for v in given.values()):
      raise UserError(f"multi-process flags {given}: pass all three of --coordinator_address, "
                       "--num_processes and --process_id, or none (cluster auto-detection "
                       "with --multihost)")
    if self.explicit:
      if ":" not in self.coordinator_address:
        raise UserError(f"--coordinator_address={self.coordinator_address!r} must be HOST:PORT")
      if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
        raise UserError(f"--process_id={self.process_id} must be in [0, --num_processes="
                         f"{self.num_processes})")
    for name in ("heartbeat_timeout_s", "initialization_timeout_s"):
      if getattr(self, name) < 1:
        raise UserError(f"--{name}={getattr(self, name)} must be >= 1 (seconds)")

  def initialize(self) -> None:
    """Joins the job. Recoverability is on, so the coordination service does not abort the
    processes left when one is lost: the `Watchdog` names it and ends this process instead."""
    import jax
    jax.config.update("jax_enable_recoverability", True)
    kwargs = dict(initialization_timeout=self.initialization_timeout_s,
                  heartbeat_timeout_seconds=self.heartbeat_timeout_s)
    if self.explicit:
      kwargs.update(coordinator_address=self.coordinator_address,
                    num_processes=self.num_processes, process_id=self.process_id)
    try:
      jax.distributed.initialize(**kwargs)
    except ValueError as e:  # JAX's words when no cluster environment names a coordinator
      if self.explicit or "coordinator_address should be defined" not in str(e):
        raise
      raise UserError("--multihost found no cluster to join (no SLURM, Open MPI or Kubernetes "
                      "job in the environment); name the job with --coordinator_address="
                      "HOST:PORT --num_processes=N --process_id=I, or leave out --multihost "
                      "for one process") from e


def lost_line(me: int, count: int, lost: list[int], why: str, workdir: str) -> str:
  """The one line a process prints when processes ``lost`` of the job are gone."""
  names = ", ".join("the coordinator, process 0" if p == 0 else f"process {p}" for p in lost)
  return (f"process {me}/{count}: lost {names} ({why}); rerun the job to resume from the "
          f"newest verified checkpoint ({newest_checkpoint(workdir)})")


class Watchdog:
  """Ends this process (exit status 2, one line on stderr naming the lost process) when another
  process of the job is lost or the coordinator stops answering.

  Every ``poll_s`` seconds its thread writes this process's heartbeat (a counter) to the
  coordination service's key-value store and reads every process's: a process whose counter
  has not moved for ``heartbeat_timeout_s`` seconds is lost, and a failed write or read means
  the coordinator is. Both calls return at once: no process waits on another. (The service's
  own liveness query, ``get_live_nodes``, is a barrier of every live process: a poll of it
  returns only once every live process polls too, so one process's poll blocks while the others
  train, and a poll started as the others stop their watchdogs never returns.) It runs until
  every process has reached the job's exit barrier (`_finish`), so a process lost after the
  others finished is named too.

  It ends the process with ``os._exit``: the main thread may be inside a collective that waits
  for the lost process forever (NCCL) or that JAX aborts on, so no clean exit is possible; the
  line is flushed first and nothing else is written after it."""

  KEY = "distca/beat/"

  def __init__(self, workdir: str, heartbeat_timeout_s: float, poll_s: float = 1.0, *,
               client=None, me: int | None = None, count: int | None = None):
    """``client``, ``me`` and ``count`` default to this process's JAX distributed client, index
    and process count (tests pass clients of an in-process service)."""
    import jax
    self.me = jax.process_index() if me is None else me
    self.count = jax.process_count() if count is None else count
    self._client = client or distributed_state().client
    self._where = "" if client else f" at {distributed_state().coordinator_address}"
    self._workdir, self._poll_s = workdir, poll_s
    self._timeout_s = heartbeat_timeout_s
    self._stop = threading.Event()
    self.fired = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True, name="distca-watchdog")
    self._thread.start()

  def _run(self) -> None:
    client, beat = self._client, 0
    peers = [p for p in range(self.count) if p != self.me]
    changed = dict.fromkeys(peers, time.monotonic())  # when each peer's counter last moved
    value: dict[int, str] = {}
    while not self._stop.is_set():
      beat += 1
      try:
        client.key_value_set(f"{self.KEY}{self.me}", str(beat), allow_overwrite=True)
        got = dict(client.key_value_dir_get(self.KEY))
      except Exception as e:  # pylint: disable=broad-except  # the coordinator's RPC failed
        if not self._stop.is_set():
          why = " ".join(str(e).split())[:160]
          self._exit([0], f"the coordinator{self._where} does not answer: {why}")
        return
      now = time.monotonic()
      for p in peers:
        v = got.get(f"{self.KEY}{p}")
        if v is not None and v != value.get(p):
          value[p], changed[p] = v, now
      lost = [p for p in peers if now - changed[p] >= self._timeout_s]
      if lost and not self._stop.is_set():
        self._exit(lost, f"no heartbeat for {self._timeout_s:g} s")
        return
      self._stop.wait(self._poll_s)

  def _exit(self, lost: list[int], why: str) -> None:
    self.fired.set()
    print("error: " + lost_line(self.me, self.count, lost, why, self._workdir), file=sys.stderr,
          flush=True)
    sys.stdout.flush()
    os._exit(2)  # see the class docstring

  def close(self, wait: bool = True) -> None:
    """Stops the heartbeats; ``wait=False`` does not wait for a key-value call in flight (an
    error is on its way out and must be printed before the coordinator, maybe ending too, takes
    the job down)."""
    self._stop.set()
    if wait:
      self._thread.join()


def run(config: ml_collections.ConfigDict, workdir: str, *, multihost: bool = False,
        verbose: bool = False, distributed: Distributed | None = None, stop=None):
  """Sets up the process and trains; `verbose` keeps library INFO logs (orbax is chatty).

  ``multihost`` (or an explicit ``distributed.coordinator_address``) joins a multi-process job
  first and runs a `Watchdog`; the job ends with a barrier of every process, then the client
  shuts down. A runtime error of a multi-process job (a collective whose peer is gone) waits
  for the watchdog to name the lost process (up to the heartbeat timeout + 15 s) and is raised
  when none was lost. ``stop`` (`stop.StopRequest`) is set by signal handlers. A baseline
  configuration the config leaves to the run is chosen before training (``choose.resolve``).
  """
  configure_environment()
  distributed = distributed or Distributed()
  distributed.check()
  if stop is not None:
    stop.workdir = workdir
    stop.timeout_s = float(config.train.stop_timeout_s)
  if not verbose:
    from absl import logging
    logging.set_verbosity(logging.WARNING)
  import jax
  watchdog = None
  if multihost or distributed.explicit:
    distributed.initialize()
    if os.environ.get(SUPERVISED_ENV):
      print(f"{JOINED_MARK}{jax.process_index()}/{jax.process_count()}", file=sys.stderr,
            flush=True)
    watchdog = Watchdog(workdir, distributed.heartbeat_timeout_s)
    if stop is not None:  # JAX's preemption notifier took SIGTERM in initialize(): take it back
      for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
  from distca_jax import choose, memory, trainer
  try:
    try:
      # A baseline's configuration left to the run is chosen here, where its candidates' steps
      # can be compiled (choose), and reaches the trainer as config values.
      config = choose.resolve(config, log=(lambda line: print(line, flush=True))
                              if jax.process_index() == 0 else None)
      out = trainer.train_and_evaluate(
          config, workdir, device_memory_bytes=_injected_capacity(), stop=stop)
    except memory.DoesNotFit as e:  # add what each knob would need (compiles variants: slow path)
      from distca_jax import aot
      raise aot.explain_does_not_fit(config, e) from e.__cause__
    except trainer.Interrupted:
      if watchdog is not None:
        _finish(watchdog)
      raise
  except jax.errors.JaxRuntimeError:
    if watchdog is not None:  # a lost peer: the watchdog ends the process naming it
      watchdog.fired.wait(distributed.heartbeat_timeout_s + 15)
      watchdog.close()
    raise
  except BaseException:
    if watchdog is not None:
      watchdog.close(wait=False)
    raise
  if watchdog is not None:
    _finish(watchdog)
  return out


def _finish(watchdog: Watchdog, timeout_s: float = 600) -> None:
  """Leaves the job: every process waits for the others at a barrier, its watchdog still
  running (a process lost before it reaches the barrier is named); then the others disconnect,
  and the coordinator (process 0, which hosts the service) waits up to ``timeout_s`` until they
  have before it stops the service (a process still connected when the service stops is aborted
  by JAX's runtime). That wait is ``get_live_nodes``: a barrier of the live processes, which the
  others never enter, so it returns once they have disconnected."""
  import jax
  client = distributed_state().client
  client.wait_at_barrier("distca_exit", int(timeout_s * 1000))
  watchdog.close()
  if jax.process_index() == 0 and jax.process_count() > 1:
    gone = threading.Thread(target=client.get_live_nodes, args=(list(range(jax.process_count())),),
                            daemon=True)
    gone.start()
    gone.join(timeout_s)
  jax.distributed.shutdown()


# Test hook: pretend each device has this many bytes (the memory pre-flight on CPUs).
DEVICE_MEMORY_ENV = "DISTCA_TEST_DEVICE_MEMORY_BYTES"


def _injected_capacity() -> int | None:
  value = os.environ.get(DEVICE_MEMORY_ENV)
  return int(value) if value else None


# ----------------------------------------------------------------------------------------------
# Supervision of a multi-process job's processes
# ----------------------------------------------------------------------------------------------
JOINED_MARK = "distca-joined "        # the child's stderr line 'distca-joined I/N' (not shown)
# Lines that start what a process prints when JAX's runtime aborts it (absl FATAL / ERROR logs,
# C++ terminate, faulthandler) or when Python dies of an internal error.
_DUMP_START = re.compile(r"^([EF]\d{4} |\*\*\* |terminate called|Fatal Python error|"
                         r"Traceback \(most recent call last\)|=== Source Location|"
                         r"W\d{4} .*(preemption_sync_manager|coordination_service_agent|"
                         r"pjrt_client\.cc.*WatchTasks))")


_KNOWN_NOTICE = re.compile(r"^W\d{4} .*Using experimental recoverable task feature")
# JAX's runtime aborts a process whose registration with the coordination service timed out:
# not every process reached the coordinator within the initialization timeout.
_JOIN_FAILED = re.compile(r"DEADLINE_EXCEEDED[\s\S]{0,200}CoordinationService/RegisterTask")


def _die_with_parent() -> None:
  """In the child (preexec): SIGKILL when the supervisor dies, so a killed job leaves nothing."""
  import ctypes
  ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def explain_abort(text: str, me: int | None, count: int | None) -> tuple[list[int] | None, str]:
  """(lost processes, why) read from the output of a process that JAX's runtime aborted;
  (None, '') when it names no lost peer."""
  if re.search(r"leader task was preempted|Failed to send RPC to coordination service", text):
    return [0], "the coordinator stopped answering"
  m = re.search(r"stopped sending heartbeats\):\s*([\d,\s]+)", text)
  if m:
    return sorted({int(x) for x in re.findall(r"\d+", m.group(1))}), "no heartbeat"
  m = re.search(r"(Connection closed by peer|Connection reset by peer|gloo::\w+)[^\n]{0,80}", text)
  if m and me is not None and count == 2:
    return [1 - me], f"its connection broke: {' '.join(m.group(0).split())}"
  if m:
    return None, f"a peer's connection broke: {' '.join(m.group(0).split())}"
  return None, ""


def _headline(lines: list[str]) -> str:
  """The line that says what went wrong in a dump: the message of absl's first FATAL line, else
  the last line that is not faulthandler's list of modules or threads."""
  for line in lines:
    m = re.match(r"^F\d{4} [^\]]*\] (.*)", line)
    if m:
      return m.group(1).strip()
  return next((l.strip() for l in reversed(lines) if l.strip() and not l.startswith(
      ("Extension modules:", "Current thread", "Thread 0x", "  File "))), "")


def join_failed_line(who: str, distributed: Distributed | None) -> str:
  """The line of a process that could not join its job (registration timed out)."""
  address = f" at {distributed.coordinator_address}" if distributed and distributed.explicit else ""
  seconds = f"={distributed.initialization_timeout_s} s" if distributed else ""
  return (f"{who} could not join the job: not every process reached the coordinator{address} "
          f"within --initialization_timeout_s{seconds}; start every process with the same "
          "--coordinator_address and --num_processes (process 0 hosts the coordinator, so "
          "its host must be reachable on that port)")


def _keep_dump(text: str, workdir: str, me: int | None) -> str:
  """Writes a child's kept output (its dump) to ``workdir/crash/process<me>-<time>.log``, next
  to the run's other files, or to a temporary file where the workdir cannot take it (e.g. read
  only); returns the path."""
  name = f"process{me if me is not None else ''}-{time.strftime('%Y%m%dT%H%M%S')}-"
  try:
    folder = os.path.join(workdir, "crash")
    os.makedirs(folder, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=name, suffix=".log", dir=folder)
  except OSError:
    fd, path = tempfile.mkstemp(prefix=f"distca-{name}", suffix=".log")
  with os.fdopen(fd, "w") as f:
    f.write(text)
  return path


def supervise(argv: list[str], workdir: str, verbose: bool, me: int | None = None,
              count: int | None = None, distributed: Distributed | None = None) -> int:
  """Runs this command again as a child process and returns the exit status to end with.

  The child's stdout passes through. Its stderr passes through up to the first line of a dump
  (``_DUMP_START``: an abort of JAX's runtime or an internal error's traceback); the rest is kept
  in a log file under the workdir (``crash/``), named in the last line, and shown with
  ``verbose``. When the child ends without
  its own 'error:' or 'interrupted' line, the supervisor prints one (the lost process, read from
  the dump, or a job it could not join) and returns 2, or 1 for an internal error. SIGINT and
  SIGTERM are passed on once the child has joined the job; before that (JAX's join does not
  return to Python until every process arrives or its timeout passes, and there is no state to
  save) the child is killed and the supervisor says so and returns 128 + the signal."""
  env = dict(os.environ, **{SUPERVISED_ENV: "1"})
  # The same entry point: the train module, or the script that called its main.
  entry = (["-m", "distca_jax.train"] if os.path.basename(argv[0]) in ("train.py", "-m")
           else [argv[0]])
  child = subprocess.Popen([sys.executable, *entry] + argv[1:], env=env,
                           stderr=subprocess.PIPE, text=True, errors="replace",
                           preexec_fn=_die_with_parent)
  joined, before_join = [], []  # (one entry when set) the child joined; a signal before that

  def on_signal(signum, _):
    if joined:
      child.send_signal(signum)
    elif not before_join:
      before_join.append(signum)
      child.kill()

  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, on_signal)
  kept: list[str] = []
  dumping, ours = verbose, None  # ours: the child's own last line ('error' or 'interrupted')
  for line in child.stderr:
    if line.startswith(JOINED_MARK):
      me, count = (int(x) for x in line[len(JOINED_MARK):].split("/"))
      joined.append(True)
      continue
    if line.startswith(("error: ", "interrupted")):
      ours = line.split(":")[0].split()[0]
    dumping = dumping or bool(_DUMP_START.match(line))
    quiet = bool(_KNOWN_NOTICE.match(line))  # JAX's notice that recoverability is on
    if (dumping or quiet) and not verbose and not line.startswith(("error: ", "interrupted")):
      kept.append(line)
    else:
      sys.stderr.write(line)
      sys.stderr.flush()
  rc = child.wait()
  if rc == 0 or ours == "error":  # exit status 2 even when the runtime aborted after the line
    return 2 if ours else 0
  if ours == "interrupted":
    return rc if rc > 128 else 128 + signal.SIGTERM
  who = f"process {me}/{count}" if me is not None else "this process"
  if before_join and not ours:
    print(f"interrupted: interrupted by {signal.Signals(before_join[0]).name} while {who} was "
          "joining the job, before its first step (nothing to save); rerun the same command to "
          "start it", file=sys.stderr, flush=True)
    return 128 + before_join[0]
  text = "".join(kept)
  log = ""
  if kept:
    log = f"; its output: {_keep_dump(text, workdir, me)}"
  lost, why = explain_abort(text, me, count)
  if lost is not None:
    line = lost_line(me if me is not None else -1, count or 0, lost, why, workdir)
    print("error: " + line.replace("process -1/0", who) + log, file=sys.stderr, flush=True)
    return 2
  if not joined and _JOIN_FAILED.search(text):
    print(f"error: {join_failed_line(who, distributed)}{log}", file=sys.stderr, flush=True)
    return 2
  last = _headline(kept)
  how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
  print(f"error: {who} failed ({how}{'; ' + why if why else ''}): {last[:300]}{log}; rerun "
        "with --verbose to see its output", file=sys.stderr, flush=True)
  return 2 if why else 1


if __name__ == "__main__":
  # `python -m distca_jax.launch` is the training entry point under another name: it runs
  # `distca_jax.train` as the main module (the same flags, --help, exit statuses and supervisor).
  import runpy
  runpy.run_module("distca_jax.train", run_name="__main__", alter_sys=True)
