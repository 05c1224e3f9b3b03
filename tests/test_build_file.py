"""BUILD must list every module of the package (its globs cover tests, experiments, configs)."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _listed():
  with open(os.path.join(ROOT, "BUILD")) as f:
    return set(re.findall(r'"((?:distca_jax|custom_ops)/[\w/]+\.py)"', f.read()))


def test_every_package_module_is_in_build():
  on_disk = {os.path.relpath(p, ROOT) for pkg in ("distca_jax", "custom_ops")
             for p in glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True)}
  listed = _listed()
  assert on_disk - listed == set(), f"add to BUILD: {sorted(on_disk - listed)}"
  assert listed - on_disk == set(), f"remove from BUILD (no such file): {sorted(listed - on_disk)}"


def test_build_globs_cover_tests_and_experiments():
  with open(os.path.join(ROOT, "BUILD")) as f:
    text = f.read()
  for pattern in ('glob(["experiments/*.py"])', '["tests/test_*.py"]', 'glob(["configs/*.py"])'):
    assert pattern in text
  assert glob.glob(os.path.join(ROOT, "tests", "test_*.py"))
