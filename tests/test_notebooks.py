"""The notebooks in experiments/notebooks/: stored without outputs, public API only, 8 fake
devices set before jax is imported, and (slow tier) each runs top to bottom within 300 s in a
fresh kernel of this Python (`experiments.run_notebooks.execute_notebook`)."""

import ast
import glob
import os

import nbformat
import pytest

from experiments import run_notebooks

PATHS = sorted(glob.glob(os.path.join(run_notebooks.NOTEBOOK_DIR, "*.ipynb")))
IDS = [os.path.basename(p) for p in PATHS]
TIMEOUT_S = 300


def _code_cells(nb) -> list[str]:
  return [c.source for c in nb.cells if c.cell_type == "code"]


def test_the_notebooks_are_the_listed_ones():
  names = {os.path.splitext(i)[0] for i in IDS}
  assert names == set(run_notebooks.NOTEBOOKS), (
      "experiments/notebooks/*.ipynb and run_notebooks.NOTEBOOKS must name the same notebooks")


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_stored_without_outputs(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  for i, cell in enumerate(nb.cells):
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, (
          f"{os.path.basename(path)} cell {i} has outputs; clear them before committing "
          "(jupyter nbconvert --clear-output --inplace FILE)")


def private_names(source: str) -> list[str]:
  """Names starting with one underscore that the code imports, reads or calls (dunders and the
  throwaway `_` aside): a notebook uses the public API only."""
  bad = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
      names = [a.name for a in node.names]
      for dotted in modules + names:
        bad += [f"import of {dotted}" for part in dotted.split(".")
                if part.startswith("_") and not part.startswith("__")]
    elif isinstance(node, ast.Attribute):
      if node.attr.startswith("_") and not node.attr.startswith("__"):
        bad.append(f".{node.attr} (line {node.lineno})")
    elif isinstance(node, ast.Name):
      if node.id.startswith("_") and node.id != "_" and not node.id.startswith("__"):
        bad.append(f"{node.id} (line {node.lineno})")
  return bad


def test_private_name_check_finds_them():
  code = ("from distca_jax.plan.balancer import _State\nimport distca_jax._x\n"
          "from distca_jax.dataplane import body\nbody._device_body(1)\ny = _hidden\n"
          "x.__class__\n_ = 1\n")
  assert sorted(private_names(code)) == ["._device_body (line 4)", "_hidden (line 5)",
                                         "import of _State", "import of distca_jax._x"]


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_public_api_only(path):
  nb = nbformat.read(path, as_version=4)
  for i, source in enumerate(_code_cells(nb)):
    assert not any(line.lstrip().startswith(("%", "!")) for line in source.splitlines()), (
        f"{os.path.basename(path)} code cell {i}: no IPython magics (the cells are plain Python)")
    bad = private_names(source)
    assert not bad, f"{os.path.basename(path)} code cell {i} uses private names: {bad}"


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_fake_devices_are_set_before_jax_is_imported(path):
  cells = _code_cells(nbformat.read(path, as_version=4))
  first = cells[0]
  flag = first.find("--xla_force_host_platform_device_count=8")
  assert flag >= 0, f"{os.path.basename(path)}: the first code cell must set the 8 fake devices"
  imports = [first.find(s) for s in ("import jax", "from jax", "distca_jax") if s in first]
  assert all(flag < i for i in imports), "XLA_FLAGS must be set before jax (or the library) loads"


@pytest.mark.slow
@pytest.mark.parametrize("name", run_notebooks.NOTEBOOKS)
def test_notebook_runs(name):
  _, seconds = run_notebooks.execute_notebook(run_notebooks.notebook_path(name),
                                              timeout=TIMEOUT_S)
  print(f"{name}: {seconds:.0f} s")
  assert seconds < TIMEOUT_S
