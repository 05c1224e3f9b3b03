"""Stop requests: a signal ends the run at the next step boundary, every process of the job at
the same one.

``StopRequest`` is the signal handler (the entry point installs it; the launcher gives it the
workdir and deadline); the train loop asks ``stop_signal`` before each step and saves when it
returns a signal. The trainer and the launcher both import this module.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

SUPERVISED_ENV = "DISTCA_SUPERVISED"  # set in the child a supervisor runs (launch.supervise)


class StopRequest:
  """A signal handler that records the first signal; the train loop saves the current step and
  stops when it is set (`stop_signal`), and calls `acknowledge` as it starts to save.

  Two ways out that end the process at once (``os._exit(128 + signal)``) with one
  'interrupted' line naming the newest verified checkpoint in ``workdir``: a second signal (a
  second Ctrl-C: stop now, the save in progress, if any, is ignored on restore), and no
  acknowledgement within ``timeout_s`` seconds of the first (the loop did not reach a step
  boundary: a device call or a peer is stuck).

  In a process run by a supervisor (``SUPERVISED_ENV``), the same signal again within
  ``DUPLICATE_S`` seconds of the first is that first one delivered twice, not a second request:
  a terminal's Ctrl-C and SLURM's signals reach every process of the task (the supervisor and
  this one), and the supervisor passes its copy on."""

  DUPLICATE_S = 2.0

  def __init__(self, timeout_s: float = 120.0, workdir: str | None = None):
    self.signum: int | None = None
    self.timeout_s = timeout_s
    self.workdir = workdir
    self._timer: threading.Timer | None = None
    self._first_at = 0.0

  def __call__(self, signum, frame=None) -> None:
    del frame
    if (self.signum == signum and os.environ.get(SUPERVISED_ENV)
        and time.monotonic() - self._first_at < self.DUPLICATE_S):
      return
    if self.signum is not None:
      self._exit(signum, f"a second {signal.Signals(signum).name}: stopping now, without "
                 "saving the current step")
    self.signum, self._first_at = signum, time.monotonic()
    self._timer = threading.Timer(self.timeout_s, self._exit, (
        signum, f"the run reached no step boundary within train.stop_timeout_s="
        f"{self.timeout_s:g} s of the signal (still compiling, or a device call or another "
        "process is stuck): stopping without saving"))
    self._timer.daemon = True
    self._timer.start()

  def acknowledge(self) -> None:
    """The loop reached a step boundary and saves (or stops): the deadline no longer holds."""
    if self._timer is not None:
      self._timer.cancel()

  def _exit(self, signum: int, why: str) -> None:
    where = newest_checkpoint(self.workdir) if self.workdir else "no checkpoint yet"
    print(f"interrupted: interrupted by {signal.Signals(self.signum or signum).name}; {why}; "
          f"rerun the same command to resume from the newest verified checkpoint ({where})",
          file=sys.stderr, flush=True)
    os._exit(128 + (self.signum or signum))


def distributed_state():
  """JAX's distributed state of this process (``.client``: the coordination service client,
  ``.coordinator_address``)."""
  from jax._src import distributed as jax_distributed  # the client has no public accessor
  return jax_distributed.global_state


def newest_checkpoint(workdir: str) -> str:
  """'checkpoint step N at PATH' for the newest committed checkpoint in ``workdir`` (a rerun
  resumes from the newest one that verifies), or 'no checkpoint yet'."""
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  steps = sorted(int(n) for n in (os.listdir(directory) if os.path.isdir(directory) else [])
                 if n.isdigit())
  return (f"checkpoint step {steps[-1]} at {os.path.join(directory, str(steps[-1]))}" if steps
          else "no checkpoint yet")


def stop_signal(step: int, signum: int | None) -> int | None:
  """The signal every process of the job stops on before ``step`` (None: go on).

  One process: ``signum``. Several: each publishes its ``signum`` for ``step`` in the
  coordination service's key-value store and reads everyone's (a host-side exchange before the
  step is dispatched: no device work waits on it), so all stop before the same step even when the
  signal reached only some of them or reached them at different steps."""
  import jax
  if jax.process_count() == 1:
    return signum
  client, me, count = distributed_state().client, jax.process_index(), jax.process_count()
  client.key_value_set(f"distca/stop/{step}/{me}", str(signum or 0))
  while True:
    got = client.key_value_dir_get(f"distca/stop/{step}/")
    if len(got) >= count:
      break
    time.sleep(0.002)
  if step >= 2:
    client.key_value_delete(f"distca/stop/{step - 2}/{me}")
  signals = [int(v) for _, v in got if int(v)]
  return signals[0] if signals else None
