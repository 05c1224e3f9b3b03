"""Entry point: `python -m distca_jax.train --config configs/tiny_cpu.py --workdir DIR`.

Kept short on purpose; the job lives in `distca_jax.trainer`. Override any config key on the
command line, e.g. `--config.num_steps=50 --config.mesh.tensor=2`. Multi-host GPU jobs call
`jax.distributed.initialize()` first: pass `--multihost` to detect the cluster (SLURM, Open MPI,
Kubernetes), or name the job with `--coordinator_address=HOST:PORT --num_processes=N
--process_id=I` (one command per process; process 0 alone prints progress and writes metrics).
"""

from absl import app, flags
from ml_collections import config_flags

from distca_jax import launch

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
flags.DEFINE_integer("heartbeat_timeout_s", 100, "A process silent this long is declared dead "
                     "and the others stop with an error.")
flags.DEFINE_integer("initialization_timeout_s", 300, "Seconds to wait for every process to join.")
flags.DEFINE_bool("verbose", False, "Keep INFO logs of libraries (orbax, absl).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  distributed = launch.Distributed(
      coordinator_address=FLAGS.coordinator_address, num_processes=FLAGS.num_processes,
      process_id=FLAGS.process_id, heartbeat_timeout_s=FLAGS.heartbeat_timeout_s,
      initialization_timeout_s=FLAGS.initialization_timeout_s)
  launch.run(FLAGS.config, FLAGS.workdir, multihost=FLAGS.multihost, verbose=FLAGS.verbose,
             distributed=distributed)


if __name__ == "__main__":
  app.run(main)
