"""The test tiers: `slow` is a registered marker and every test file keeps a fast test, so the
fast tier (`pytest -m "not slow" tests`) reaches every module."""

import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_FILES = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "tests", "test_*.py"))}


def test_slow_marker_is_registered_and_strict(pytestconfig):
  names = [line.split(":")[0].strip() for line in pytestconfig.getini("markers")]
  assert "slow" in names, "register the marker: [tool.pytest.ini_options] markers in pyproject.toml"
  assert "--strict-markers" in pytestconfig.getini("addopts"), "a misspelt marker must be an error"


def _fast_files_collected():
  """Test files with a test that is not marked slow, by collecting the fast tier in a child."""
  proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow",
                         "-p", "no:cacheprovider", "tests"], cwd=ROOT, capture_output=True,
                        text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return {line.split("::")[0].split("/")[-1] for line in proc.stdout.splitlines() if "::" in line}


def test_every_test_file_has_a_fast_test(request):
  # The running session answers when it collected every file (a full or fast-tier run);
  # otherwise a child collects the fast tier.
  items = request.session.items
  seen = {os.path.basename(str(i.path)) for i in items}
  if seen >= TEST_FILES:
    fast = {os.path.basename(str(i.path)) for i in items if i.get_closest_marker("slow") is None}
  else:
    fast = _fast_files_collected()
  missing = sorted(TEST_FILES - fast)
  assert not missing, f"no fast test in {missing}: add one that is not @pytest.mark.slow"
