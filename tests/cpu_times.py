"""A pytest plugin that writes where each test's time goes, for profiling the tiers:
`PYTHONPATH=tests pytest -p cpu_times ...` writes $DISTCA_TEST_TIMES (default test_times.json;
under pytest-xdist one file per worker, NAME.gw0.json, ...) and, a line per test as it ends,
the same path + "l" (JSON lines):
per test (setup + call + teardown) the wall seconds, this process's CPU seconds (all its
threads), its waited-for subprocesses' CPU seconds, and the seconds JAX spent tracing, lowering
and compiling (XLA backend); plus the collection's wall and CPU seconds."""

import json
import os
import resource
import time

import pytest

_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "compile"}
_acc = {"trace": 0.0, "lower": 0.0, "compile": 0.0, "n_compile": 0}
_rows = {}
_collect = {}


def _listen(event, duration, **kwargs):
  del kwargs
  key = _EVENTS.get(event)
  if key:
    _acc[key] += duration
    if key == "compile":
      _acc["n_compile"] += 1


def _children_cpu():
  r = resource.getrusage(resource.RUSAGE_CHILDREN)
  return r.ru_utime + r.ru_stime


def pytest_configure(config):
  del config
  import jax  # imported by conftest.py already, after its environment setup
  jax.monitoring.register_event_duration_secs_listener(_listen)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
  w, c = time.perf_counter(), time.process_time()
  result = yield
  _collect.update(wall=time.perf_counter() - w, cpu=time.process_time() - c)
  return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  before = dict(_acc)
  w, c, k = time.perf_counter(), time.process_time(), _children_cpu()
  result = yield
  row = {"wall": time.perf_counter() - w, "cpu": time.process_time() - c,
         "child_cpu": _children_cpu() - k,
         "slow": item.get_closest_marker("slow") is not None}
  row.update({key: _acc[key] - before[key] for key in _acc})
  _rows[item.nodeid] = row
  with open(_path() + "l", "a") as f:  # one JSON line per test as it ends: partial runs count
    f.write(json.dumps({"test": item.nodeid, **row}) + "\n")
  return result


def _path():
  path = os.environ.get("DISTCA_TEST_TIMES", "test_times.json")
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  if worker:  # pytest-xdist: one file per worker (the controller runs no tests)
    path = f"{os.path.splitext(path)[0]}.{worker}.json"
  return path


def pytest_sessionfinish(session):
  del session
  if not _rows:
    return
  with open(_path(), "w") as f:
    json.dump({"collection": _collect, "tests": _rows,
               "process_cpu_total": time.process_time(), "pid": os.getpid()}, f, indent=1)


def summary(paths, top=25) -> str:
  """Markdown tables of the runs in ``paths`` (this plugin's JSON or JSON-lines files; several
  files are the workers of one run): totals, per test file, and the ``top`` costliest tests."""
  rows = {}
  for path in paths:
    with open(path) as f:
      if path.endswith(".jsonl"):
        rows.update({r.pop("test"): r for r in map(json.loads, f)})
      else:
        rows.update(json.load(f)["tests"])
  keys = ("wall", "cpu", "child_cpu", "trace", "lower", "compile", "n_compile")
  files = {}
  for name, r in rows.items():
    acc = files.setdefault(name.split("::")[0], dict.fromkeys(keys + ("n",), 0))
    acc["n"] += 1
    for k in keys:
      acc[k] += r[k]
  head = ("| {} | tests | CPU s | subprocess CPU s | trace+lower s | XLA compile s | compiles "
          "| wall s |\n|---|---|---|---|---|---|---|---|")
  line = "| {} | {n} | {cpu:.1f} | {child_cpu:.1f} | {tl:.1f} | {compile:.1f} | {n_compile} | {wall:.1f} |"
  total = {k: sum(a[k] for a in files.values()) for k in keys + ("n",)}
  out = [head.format("run"), line.format("all", tl=total["trace"] + total["lower"], **total), "",
         head.format("file")]
  for name, a in sorted(files.items(), key=lambda kv: -kv[1]["cpu"] - kv[1]["child_cpu"]):
    out.append(line.format(name, tl=a["trace"] + a["lower"], **a))
  out += ["", head.format("test")]
  for name, r in sorted(rows.items(), key=lambda kv: -kv[1]["cpu"] - kv[1]["child_cpu"])[:top]:
    out.append(line.format(name, n=1, tl=r["trace"] + r["lower"], **r))
  return "\n".join(out)


if __name__ == "__main__":
  import sys
  print(summary(sys.argv[1:]))
