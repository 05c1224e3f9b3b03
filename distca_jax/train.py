"""Entry point: `python -m distca_jax.train --config configs/tiny_cpu.py --workdir DIR`.

Kept short on purpose; the job lives in `distca_jax.trainer`. Override any config key on the
command line, e.g. `--config.num_steps=50 --config.mesh.tensor=2`. Multi-host GPU jobs call
`jax.distributed.initialize()` first: pass `--multihost` to detect the cluster (SLURM, Open MPI,
Kubernetes), or name the job with `--coordinator_address=HOST:PORT --num_processes=N
--process_id=I` (one command per process; process 0 alone prints progress and writes metrics).

Every run ends in one of three ways: success (exit 0); one line `error: ...` on stderr with exit
status 2 (`errors.UserError`: config, data, mesh, flags, checkpoints, divergence, memory, an
unwritable workdir, and a lost process of a multi-process job); or, on SIGINT / SIGTERM, one line
`interrupted ...` after the current step is saved and verified, with exit status 128 + the
signal. `--verbose` adds tracebacks and library logs. A process of a multi-process job runs
under a supervisor (`launch.supervise`), which turns an abort of JAX's runtime into that line.
"""

import os
import re
import signal
import sys

from absl import app, flags
from ml_collections import config_flags

from distca_jax import configs_io, launch, stop as stop_lib
from distca_jax.errors import UserError

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints, metrics.jsonl and TensorBoard events go here; "
                    "a workdir holding a checkpoint resumes from it.")
flags.DEFINE_bool("multihost", False, "Call jax.distributed.initialize() before anything else.")
flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0's coordinator service "
                    "(with --num_processes and --process_id; implies --multihost).")
flags.DEFINE_integer("num_processes", None, "Processes in the job (with --coordinator_address).")
flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")
flags.DEFINE_integer("heartbeat_timeout_s", 30, "A process whose heartbeats stop this long is "
                     "declared lost and the others stop with an error naming it.")
flags.DEFINE_integer("initialization_timeout_s", 300, "Seconds to wait for every process to join.")
flags.DEFINE_bool("verbose", False, "Keep INFO logs of libraries (orbax, absl) and show the "
                  "traceback of bad-input errors.")
flags.mark_flags_as_required(["config", "workdir"])


def _exit_with(message: str) -> None:
  print("error: " + " ".join(message.split("\n")), file=sys.stderr, flush=True)
  sys.exit(2)


def _config_path(argv) -> str | None:
  """The value of `--config` in `argv` (None when absent)."""
  return next((a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else None)
               for i, a in enumerate(argv) if re.fullmatch(r"--config(=.*)?", a)), None)


def _override_problem(argv, err: Exception) -> str:
  """The one-line reason a `--config.KEY=VALUE` override failed to parse."""
  path = _config_path(argv)
  overrides = [a[len("--config."):] for a in argv if a.startswith("--config.")]
  if path is not None:
    try:
      c = configs_io.load_config(path)
    except Exception:  # pylint: disable=broad-except  # the config file's own error wins
      c = None
    if c is not None:
      keys = set(configs_io.config_keys(c))
      for item in overrides:
        key = item.split("=", 1)[0]
        if key not in keys:
          return configs_io.unknown_key_message(c, key) + f" (from --config.{item})"
  return f"bad config override ({', '.join('--config.' + o for o in overrides)}): {err}"


def _parse_flags(argv):
  path = _config_path(argv)
  # ml_collections loads the config file lazily and reports a missing one with a traceback
  # at its first use; a path without a file is bad input, said here in one line.
  if path is not None and not os.path.isfile(path.split(":", 1)[0]):
    _exit_with(f"--config={path}: no such file; pass a config file such as configs/tiny_cpu.py "
               "(paths are relative to the current directory)")
  try:
    return FLAGS(argv)
  except flags.Error as e:  # a missing, unknown or mistyped flag (absl's own errors)
    if "--verbose" in argv:
      raise
    _exit_with(f"{str(e).rstrip('.')}; --help lists the flags")
  except (AttributeError, KeyError, TypeError, ValueError) as e:  # config overrides
    if "--verbose" in argv:
      raise
    _exit_with(_override_problem(argv, e))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  distributed = launch.Distributed(
      coordinator_address=FLAGS.coordinator_address, num_processes=FLAGS.num_processes,
      process_id=FLAGS.process_id, heartbeat_timeout_s=FLAGS.heartbeat_timeout_s,
      initialization_timeout_s=FLAGS.initialization_timeout_s)
  if ((FLAGS.multihost or distributed.explicit)
      and not os.environ.get(stop_lib.SUPERVISED_ENV)):
    try:
      distributed.check()
    except UserError as e:
      _exit_with(str(e))
    sys.exit(launch.supervise(sys.argv, FLAGS.workdir, FLAGS.verbose, FLAGS.process_id,
                              FLAGS.num_processes, distributed))
  stop = stop_lib.StopRequest()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, stop)
  from distca_jax import trainer
  try:
    launch.run(FLAGS.config, FLAGS.workdir, multihost=FLAGS.multihost, verbose=FLAGS.verbose,
               distributed=distributed, stop=stop)
  except trainer.Interrupted as e:
    print(f"interrupted: {e}", file=sys.stderr, flush=True)
    sys.exit(128 + e.signum)
  except trainer.TrainingDiverged as e:
    if FLAGS.verbose:
      raise
    command = [".venv/bin/python" if os.path.realpath(sys.executable) == os.path.realpath(
        ".venv/bin/python") else sys.executable, "-m", "distca_jax.train"] + sys.argv[1:]
    _exit_with(f"{e}: {e.command_line(command)}")
  except UserError as e:
    if FLAGS.verbose:
      raise
    _exit_with(str(e))


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
