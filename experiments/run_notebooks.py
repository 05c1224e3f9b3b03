"""Execute the notebooks in experiments/notebooks/ headless and save their figures as PNGs.

Each notebook runs top to bottom in a fresh kernel of this Python (its own 8 fake CPU devices,
set in the notebook's first cell), from the repository root; the stored notebooks stay without
outputs. With ``--png-dir`` the notebooks write every figure they draw there as
``<notebook>_<figure>.png`` (they read ``$DISTCA_NOTEBOOK_PNG_DIR``).

Run:
  .venv/bin/python -m experiments.run_notebooks --png-dir results/notebooks   # all four, ~3 min
  .venv/bin/python -m experiments.run_notebooks planning                      # one, no PNGs

Prints each notebook's wall time (CPU; inflated when other jobs share the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(ROOT, "experiments", "notebooks")
NOTEBOOKS = ("planning", "data_plane", "training", "pipeline_4d")
PNG_DIR_ENV = "DISTCA_NOTEBOOK_PNG_DIR"
KERNEL_NAME = "distca-notebook"


def notebook_path(name: str) -> str:
  """The path of notebook ``name`` (one of ``NOTEBOOKS``)."""
  if name not in NOTEBOOKS:
    raise ValueError(f"unknown notebook {name!r}; choose one of {list(NOTEBOOKS)}")
  return os.path.join(NOTEBOOK_DIR, name + ".ipynb")


def write_kernelspec(directory: str, python: str = sys.executable) -> str:
  """Writes a kernel spec running ``python -m ipykernel_launcher`` under ``directory``; returns
  its kernel name. The spec names the interpreter by its path, so the kernel imports what this
  environment has installed whatever ``python`` on PATH is."""
  spec_dir = os.path.join(directory, KERNEL_NAME)
  os.makedirs(spec_dir, exist_ok=True)
  spec = {"argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
          "display_name": "distca-jax (this venv)", "language": "python"}
  with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
    json.dump(spec, f)
  return KERNEL_NAME


def execute_notebook(path: str, *, timeout: float = 300.0, png_dir: str | None = None):
  """Runs the notebook at ``path`` in a fresh kernel of this Python, from the repository root.

  Args:
    path: an .ipynb file.
    timeout: seconds allowed for the whole notebook (and for any one cell).
    png_dir: if set, the notebook saves its figures there (``$DISTCA_NOTEBOOK_PNG_DIR``).

  Returns:
    (the executed notebook, its wall seconds). Raises ``nbclient.exceptions.CellExecutionError``
    naming the failing cell, or ``TimeoutError`` past ``timeout``.
  """
  try:
    import nbclient  # pylint: disable=import-outside-toplevel
    import nbformat  # pylint: disable=import-outside-toplevel
    from jupyter_client.kernelspec import KernelSpecManager  # pylint: disable=import-outside-toplevel
    from jupyter_client.manager import AsyncKernelManager  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("executing notebooks needs nbclient, nbformat and ipykernel: "
                      "pip install -e '.[test]'") from e
  nb = nbformat.read(path, as_version=4)
  env = dict(os.environ)
  env.pop(PNG_DIR_ENV, None)
  if png_dir:
    env[PNG_DIR_ENV] = os.path.abspath(png_dir)
  with tempfile.TemporaryDirectory() as kernels:
    name = write_kernelspec(kernels)
    km = AsyncKernelManager(kernel_name=name,
                            kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernels]))
    client = nbclient.NotebookClient(nb, km=km, timeout=timeout, kernel_name=name,
                                     resources={"metadata": {"path": ROOT}})
    t0 = time.monotonic()
    deadline = t0 + timeout
    with client.setup_kernel(env=env):
      for index, cell in enumerate(nb.cells):
        left = deadline - time.monotonic()
        if left <= 0:
          raise TimeoutError(f"{path}: over {timeout:.0f} s, stopped before cell {index}")
        client.timeout = max(1, int(left))
        client.execute_cell(cell, index)
    return nb, time.monotonic() - t0


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("names", nargs="*", default=list(NOTEBOOKS), help=f"of {list(NOTEBOOKS)}")
  p.add_argument("--png-dir", default=None, help="save the notebooks' figures here")
  p.add_argument("--timeout", type=float, default=300.0, help="seconds per notebook")
  p.add_argument("--executed-dir", default=None,
                 help="also write the executed notebooks (with outputs) here")
  args = p.parse_args()
  if args.png_dir:
    os.makedirs(args.png_dir, exist_ok=True)
  for name in args.names:
    nb, seconds = execute_notebook(notebook_path(name), timeout=args.timeout,
                                   png_dir=args.png_dir)
    if args.executed_dir:
      import nbformat  # pylint: disable=import-outside-toplevel
      os.makedirs(args.executed_dir, exist_ok=True)
      nbformat.write(nb, os.path.join(args.executed_dir, name + ".ipynb"))
    print(f"{name}: {seconds:.0f} s (CPU wall time)", flush=True)


if __name__ == "__main__":
  main()
