"""The house: the docs name what exists (every module, script or file of `distca_jax/`,
`custom_ops/` and `experiments/` that README.md, docs/*.md, results/README.md or
experiments/README.md names; a name after `REV:`, a `git show REV:path` of a removed file, is
history and is not checked), experiments/README.md indexes every experiment, and results/ holds
results, no programs."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "results/README.md", "experiments/README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
NAME = re.compile(r"(?<![\w:/.-])((?:distca_jax|custom_ops|experiments)(?:[./][A-Za-z_][\w-]*)+"
                  r"(?:\.(?:py|sh|md|ipynb|cu|json))?/?)")


def _resolves(ref: str) -> bool:
  """Whether ``ref`` names something in the tree: a path (``a/b.py``, ``a/b/``) that exists, or
  a dotted module path whose modules exist and whose first name past them is a submodule or a
  name its package's ``__init__`` mentions (a name inside a module is not checked)."""
  if "/" in ref:
    return os.path.exists(os.path.join(ROOT, ref))
  parts = ref.split(".")
  if parts[-1] in ("py", "sh", "md", "ipynb"):
    return os.path.exists(os.path.join(ROOT, *parts[:-2], f"{parts[-2]}.{parts[-1]}"))
  where = os.path.join(ROOT, parts[0])
  for name in parts[1:]:
    if os.path.isfile(os.path.join(where, f"{name}.py")):
      return True
    if os.path.isdir(os.path.join(where, name)):
      where = os.path.join(where, name)
      continue
    init = os.path.join(where, "__init__.py")
    return os.path.isfile(init) and re.search(rf"\b{re.escape(name)}\b", open(init).read())
  return True


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_module_exists(doc):
  text = open(os.path.join(ROOT, doc)).read()
  bad = sorted({m.group(1) for m in NAME.finditer(text) if not _resolves(m.group(1))})
  assert not bad, f"{doc} names what the tree does not hold: {bad}"


def test_the_name_check_can_fail():
  assert _resolves("experiments.e2e_bench") and _resolves("distca_jax/plan/")
  assert _resolves("custom_ops.fills_of") and _resolves("distca_jax.plan.schedule")
  assert not _resolves("experiments.no_such_bench")
  assert not _resolves("distca_jax/no_such.py") and not _resolves("custom_ops.no_such_name")


def test_experiments_readme_indexes_every_experiment():
  text = open(os.path.join(ROOT, "experiments", "README.md")).read()
  rows = set(re.findall(r"^\| ([a-z_0-9]+) \|", text, re.M)) - {"module"}  # the header
  on_disk = {os.path.basename(p)[:-len(".py")]
             for p in glob.glob(os.path.join(ROOT, "experiments", "*.py"))} - {"__init__"}
  parts = {m for m in on_disk if re.search(rf"`{m}`", text)} - rows  # named in another row
  assert on_disk - rows - parts == set(), f"index in experiments/README.md: {on_disk - rows}"
  assert rows - on_disk == set(), f"experiments/README.md indexes no such module: {rows - on_disk}"
  for script in glob.glob(os.path.join(ROOT, "experiments", "*.sh")):
    assert f"`{os.path.basename(script)}`" in text, f"experiments/README.md: {script}"


def test_results_hold_no_programs():
  """Programs live in experiments/ (a one-off run's command is noted beside its results)."""
  found = sorted(os.path.relpath(os.path.join(d, f), ROOT)
                 for d, _, files in os.walk(os.path.join(ROOT, "results")) for f in files
                 if f.endswith((".py", ".sh", ".ipynb", ".bash")))
  assert not found, f"programs under results/ (move them to experiments/): {found}"
