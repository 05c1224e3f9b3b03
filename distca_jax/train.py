"""Entry point: `python -m distca_jax.train --config configs/tiny_cpu.py --workdir DIR`.

Kept short on purpose; the job lives in `distca_jax.trainer`. Override any config key on the
command line, e.g. `--config.num_steps=50 --config.mesh.tensor=2`. Multi-host GPU jobs call
`jax.distributed.initialize()` first (pass `--multihost`; it detects SLURM, Open MPI, Kubernetes).
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
flags.DEFINE_bool("verbose", False, "Keep INFO logs of libraries (orbax, absl).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  launch.run(FLAGS.config, FLAGS.workdir, multihost=FLAGS.multihost, verbose=FLAGS.verbose)


if __name__ == "__main__":
  app.run(main)
