"""Benchmarks and tables over the library's public API; each module runs as
``python -m experiments.<name>`` from the repository root (``--help`` lists its options)."""

import argparse
import os
import shlex
import subprocess
import sys


def command_line(module_file: str, argv=None) -> str:
  """The command that runs experiment ``module_file`` (its ``__file__``) with ``argv`` (default:
  this process's arguments), as a results table records it: ``python -m experiments.<name> ...``."""
  name = os.path.splitext(os.path.basename(module_file))[0]
  args = sys.argv[1:] if argv is None else list(argv)
  return " ".join(["python", "-m", f"experiments.{name}", *map(shlex.quote, args)])


def git_commit() -> str:
  """The repository's short HEAD commit, as a results table records it ('n/a' outside git)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                       text=True)
  return out.stdout.strip() or "n/a"


def pin_to_one_core() -> int:
  """Pins this process to the last core it may run on (planning benchmarks time one core);
  returns that core."""
  core = sorted(os.sched_getaffinity(0))[-1]
  os.sched_setaffinity(0, {core})
  return core


def module_argv(module_file: str) -> list[str]:
  """``[python, -m, experiments.<name>]`` for experiment ``module_file`` (its ``__file__``): how a
  benchmark starts its per-backend child processes (from the repository root, like the parent)."""
  name = os.path.splitext(os.path.basename(module_file))[0]
  return [sys.executable, "-m", f"experiments.{name}"]


class _RenamedFlag(argparse.Action):
  def __call__(self, parser, namespace, values, option_string=None):
    parser.error(f"{option_string} was renamed: use {self.const} (it names kernels, not "
                 "training backends)")


def reject_renamed_flag(parser: argparse.ArgumentParser, old: str, new: str) -> None:
  """Adds the hidden flag ``old``, which stops the parser with one line naming ``new``."""
  parser.add_argument(old, action=_RenamedFlag, const=new, nargs="?", help=argparse.SUPPRESS)
