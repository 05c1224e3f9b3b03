"""scripts/slurm_train.sbatch run with fake `srun` / `scontrol` on PATH: the command line each
task runs for 1, 2 and 4 nodes, the port and interpreter it picks, and the stop-and-requeue path
near the time limit; `python -m distca_jax.launch --help` prints the launcher's usage."""

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "slurm_train.sbatch")

# srun: logs its arguments, then runs the task command (after its --options) once per task with
# SLURM_PROCID set, passing SIGTERM on to the tasks as srun does, and exits with their largest
# status.
FAKE_SRUN = r"""#!/usr/bin/env bash
echo "$@" > "$FAKE_LOG/srun.args"
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i "$@" &
  pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
rc=0
for p in "${pids[@]}"; do
  while :; do
    wait "$p"; r=$?
    kill -0 "$p" 2>/dev/null || break
  done
  (( r > rc )) && rc=$r
done
exit $rc
"""
FAKE_SCONTROL = r"""#!/usr/bin/env bash
if [ "$1 $2" = "show hostnames" ]; then printf '%s\n' $FAKE_NODES; exit 0; fi
echo "$@" >> "$FAKE_LOG/scontrol.log"
"""
# The interpreter: writes its arguments, one a line; with FAKE_WAIT it runs until SIGTERM (then
# exits 143, as the trainer does after saving).
FAKE_PYTHON = r"""#!/usr/bin/env bash
printf '%s\n' "$@" > "$FAKE_LOG/python.$SLURM_PROCID"
if [ -n "${FAKE_WAIT:-}" ]; then
  trap 'exit 143' TERM
  touch "$FAKE_LOG/ready.$SLURM_PROCID"
  while :; do sleep 0.05; done
fi
"""


def _write(path, text):
  with open(path, "w") as f:
    f.write(text)
  os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_slurm(tmp_path):
  bin_dir, log = tmp_path / "bin", tmp_path / "log"
  bin_dir.mkdir()
  log.mkdir()
  _write(bin_dir / "srun", FAKE_SRUN)
  _write(bin_dir / "scontrol", FAKE_SCONTROL)
  venv = tmp_path / "submit" / ".venv" / "bin"
  venv.mkdir(parents=True)
  _write(venv / "python", FAKE_PYTHON)
  return tmp_path


def _env(root, nodes, job_id, **extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PORT", "PYTHON"))}
  env.update(PATH=f"{root / 'bin'}:{env['PATH']}", FAKE_LOG=str(root / "log"),
             FAKE_NODES=" ".join(f"gpu-{i:03d}" for i in range(nodes)), SLURM_JOB_ID=str(job_id),
             SLURM_NTASKS=str(nodes), SLURM_JOB_NODELIST=f"gpu-[000-{nodes - 1:03d}]",
             SLURM_SUBMIT_DIR=str(root / "submit"), **extra)
  return env


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_each_task_runs_the_trainer_with_the_job_flags(fake_slurm, nodes):
  """Every task runs `-m distca_jax.train` with the config, workdir and overrides, the first
  node's coordinator on the port 20000 + job id % 20000, N processes and its own process id,
  through the submit directory's absolute interpreter; srun labels the output and ends the job
  on a task's failure."""
  job = 1234567
  out = subprocess.run(["bash", SCRIPT, "configs/llama3_8b_128k.py", "/shared/run", "--config.x=1"],
                       env=_env(fake_slurm, nodes, job), cwd=str(fake_slurm), capture_output=True,
                       text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  port = 20000 + job % 20000
  python = str(fake_slurm / "submit" / ".venv" / "bin" / "python")
  assert f"coordinator gpu-000:{port}" in out.stdout and f"python {python}" in out.stdout
  srun = (fake_slurm / "log" / "srun.args").read_text().split()
  assert srun[:2] == ["--label", "--kill-on-bad-exit=1"] and srun[2:4] == ["bash", "-c"]
  for p in range(nodes):
    args = (fake_slurm / "log" / f"python.{p}").read_text().splitlines()
    assert args == ["-m", "distca_jax.train", "--config", "configs/llama3_8b_128k.py",
                    "--workdir", "/shared/run", f"--coordinator_address=gpu-000:{port}",
                    f"--num_processes={nodes}", f"--process_id={p}", "--config.x=1"]
  assert not (fake_slurm / "log" / f"python.{nodes}").exists()
  assert not (fake_slurm / "log" / "scontrol.log").exists()  # no requeue after a finished run


def test_port_and_interpreter_can_be_given(fake_slurm):
  python = fake_slurm / "other" / "python"
  python.parent.mkdir()
  _write(python, FAKE_PYTHON)
  out = subprocess.run(["bash", SCRIPT, "c.py", "w"], cwd=str(fake_slurm), capture_output=True,
                       text=True, timeout=60,
                       env=_env(fake_slurm, 2, 7, PORT="4242", PYTHON="other/python"))
  assert out.returncode == 0, out.stderr
  assert f"coordinator gpu-000:4242" in out.stdout and f"python {python}" in out.stdout
  bad = subprocess.run(["bash", SCRIPT, "c.py", "w"], cwd=str(fake_slurm), capture_output=True,
                       text=True, timeout=60,
                       env=_env(fake_slurm, 2, 7, PYTHON="/nonexistent/python"))
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines() == [
      "error: PYTHON=/nonexistent/python is not an executable interpreter; submit from the "
      "repository root (after scripts/setup.sh) or set PYTHON=/abs/path/to/python"]


def test_sbatch_header_asks_for_the_stop_signal_and_requeue():
  with open(SCRIPT) as f:
    header = [l.split()[1] for l in f if l.startswith("#SBATCH")]
  assert "--signal=B:USR1@600" in header and "--requeue" in header


@pytest.mark.parametrize("requeue", ["1", "0"])
def test_time_limit_signal_stops_the_tasks_and_requeues(fake_slurm, requeue):
  """SIGUSR1 (SLURM's --signal=B:USR1, to the batch shell) becomes one SIGTERM to the tasks
  (the trainer saves and exits 143); the script then requeues the job unless REQUEUE=0."""
  nodes, job = 2, 99
  proc = subprocess.Popen(["bash", SCRIPT, "c.py", "w"], cwd=str(fake_slurm), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=_env(fake_slurm, nodes, job, FAKE_WAIT="1", REQUEUE=requeue))
  deadline = time.time() + 30
  while (not all((fake_slurm / "log" / f"ready.{p}").exists() for p in range(nodes))
         and time.time() < deadline):
    time.sleep(0.05)
  proc.send_signal(signal.SIGUSR1)
  out, err = proc.communicate(timeout=30)
  assert proc.returncode == 143, (out, err)
  assert "time limit near (SIGUSR1)" in out
  log = fake_slurm / "log" / "scontrol.log"
  if requeue == "1":
    assert log.read_text().split() == ["requeue", str(job)]
  else:
    assert not log.exists()


def test_launch_module_prints_the_trainers_usage():
  out = subprocess.run([sys.executable, "-m", "distca_jax.launch", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 1  # absl's --help exits 1 after printing the usage
  assert out.stdout.startswith("Entry point: `python -m distca_jax.train")
  for flag in ("--config", "--workdir", "--coordinator_address", "--num_processes"):
    assert flag in out.stdout


def test_supervised_process_takes_one_signal_delivered_twice_as_one(monkeypatch):
  """A supervised process's StopRequest: the same signal twice within DUPLICATE_S is one request
  (no exit); a different signal after it is a second request (exit)."""
  from distca_jax import stop as stop_lib
  exits = []
  monkeypatch.setenv(stop_lib.SUPERVISED_ENV, "1")
  stop = stop_lib.StopRequest(timeout_s=60)
  monkeypatch.setattr(stop, "_exit", lambda signum, why: exits.append((signum, why)))
  stop(signal.SIGTERM)
  stop(signal.SIGTERM)
  assert stop.signum == signal.SIGTERM and exits == []
  stop(signal.SIGINT)
  assert exits and exits[0][0] == signal.SIGINT and "a second SIGINT" in exits[0][1]
  stop.acknowledge()
  monkeypatch.delenv(stop_lib.SUPERVISED_ENV)
  alone = stop_lib.StopRequest(timeout_s=60)
  monkeypatch.setattr(alone, "_exit", lambda signum, why: exits.append((signum, why)))
  alone(signal.SIGTERM)
  alone(signal.SIGTERM)  # not supervised: a second signal is a second request
  alone.acknowledge()
  assert len(exits) == 2 and "a second SIGTERM" in exits[1][1]
