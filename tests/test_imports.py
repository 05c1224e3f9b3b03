"""The library's import graph: no cycle, and no import from a lower floor to a higher one.

Every import of `distca_jax/` and `custom_ops/` counts, function-level ones included (a
function-level import that hides a cycle is still an import). `from pkg import name` is an import
of the module `pkg.name` when that module exists, else of `pkg` (its `__init__`); a module's
implicit import of its parent packages is not counted. The floors, lowest first (docs/design.md
Sec. 3 draws them); a module may import its own floor and the floors below:

  foundation   errors, checks, configs_io, memory, health, sharding, stop
  host         plan (NumPy only), data (the input pipeline)
  kernels      custom_ops, ops, attention (the backend contract), pipeline
  device       dataplane, model
  run parts    config, metrics, profiling, checkpoint, feed, hf_import, generate
  backends     baselines, backends
  simulator    sim, price_branch (the step's branch by price)
  trainer      trainer
  above        aot (compiles the train step), choose (a baseline's configuration, checked by
               compiling its candidates' steps), hf_export
  entry        launch, train

Run as a script (`.venv/bin/python tests/test_imports.py`) it prints every module's floor and
imports, and the cycles.
"""

import ast
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = ("distca_jax", "custom_ops")
FLOORS = (
    ("foundation", ("distca_jax.errors", "distca_jax.checks", "distca_jax.configs_io",
                    "distca_jax.memory", "distca_jax.health", "distca_jax.sharding",
                    "distca_jax.stop")),
    ("host", ("distca_jax.plan", "distca_jax.data")),
    ("kernels", ("custom_ops", "distca_jax.ops", "distca_jax.attention", "distca_jax.pipeline",
                 "distca_jax.layer_types")),
    ("device", ("distca_jax.dataplane", "distca_jax.model", "distca_jax.side_pingpong")),
    ("run parts", ("distca_jax.config", "distca_jax.metrics", "distca_jax.profiling",
                   "distca_jax.checkpoint", "distca_jax.feed", "distca_jax.hf_import",
                   "distca_jax.generate")),
    ("backends", ("distca_jax.baselines", "distca_jax.backends")),
    ("simulator", ("distca_jax.sim", "distca_jax.price_branch")),
    ("trainer", ("distca_jax.trainer",)),
    ("above", ("distca_jax.aot", "distca_jax.choose", "distca_jax.hf_export")),
    ("entry", ("distca_jax.launch", "distca_jax.train")),
)
ROOT_PACKAGE = "distca_jax"  # its __init__ is empty: below every floor


def module_name(path: str) -> str:
  rel = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def modules() -> dict[str, str]:
  """{module name: path} of every library module."""
  paths = sorted(p for pkg in LIBRARY
                 for p in glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True))
  return {module_name(p): p for p in paths}


def imports_of(path: str, known) -> dict[str, int]:
  """{imported module: first line} of every import in the file, at any depth, resolved to
  library modules (``known``); other modules are left out, except the top-level names of
  ``experiments``, ``tests`` and ``scripts``, kept so that a library import of them shows."""
  me = module_name(path)
  pkg = me if path.endswith("__init__.py") else me.rpartition(".")[0]
  out = {}

  def add(name, line):
    while name and name not in known:
      if name in ("experiments", "tests", "scripts"):
        break
      name = name.rpartition(".")[0]
    if name and name != me:
      out.setdefault(name, line)

  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Import):
      for a in node.names:
        add(a.name, node.lineno)
    elif isinstance(node, ast.ImportFrom):
      mod = node.module or ""
      if node.level:
        base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
        mod = ".".join(base + ([mod] if mod else []))
      for a in node.names:
        add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod, node.lineno)
  return out


def graph() -> dict[str, dict[str, int]]:
  known = modules()
  return {m: imports_of(p, known) for m, p in known.items()}


def floor_of(module: str) -> int | None:
  """The index in ``FLOORS`` of the longest prefix naming ``module`` (None: in no floor)."""
  if module == ROOT_PACKAGE:
    return -1
  best, where = "", None
  for i, (_, prefixes) in enumerate(FLOORS):
    for p in prefixes:
      if (module == p or module.startswith(p + ".")) and len(p) > len(best):
        best, where = p, i
  return where


def cycles(g: dict[str, dict[str, int]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan, iterative)."""
  index, low, stack, on, out, n = {}, {}, [], set(), [], 0
  for root in sorted(g):
    if root in index:
      continue
    work = [(root, iter(sorted(g[root])))]
    index[root] = low[root] = n
    n += 1
    stack.append(root)
    on.add(root)
    while work:
      v, it = work[-1]
      w = next(it, None)
      if w is not None:
        if w not in index:
          index[w] = low[w] = n
          n += 1
          stack.append(w)
          on.add(w)
          work.append((w, iter(sorted(g[w]))))
        elif w in on:
          low[v] = min(low[v], index[w])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        comp = []
        while True:
          w = stack.pop()
          on.discard(w)
          comp.append(w)
          if w == v:
            break
        if len(comp) > 1:
          out.append(sorted(comp))
  return out


def _rel(module: str) -> str:
  return os.path.relpath(modules()[module], ROOT)


def test_cycle_finder_finds_a_cycle():
  """The checks below can fail: a made-up graph with a cycle through a package has one."""
  g = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}, "e": {"e.f": 1},
       "e.f": {"e": 1}}
  assert cycles(g) == [["a", "b", "c"], ["e", "e.f"]]
  assert floor_of("distca_jax.plan.cost") < floor_of("distca_jax.trainer")
  assert floor_of("distca_jax.nope") is None


def test_every_library_module_has_a_floor():
  missing = sorted(m for m in modules() if floor_of(m) is None)
  assert not missing, f"add to FLOORS in tests/test_imports.py: {missing}"


def test_no_import_cycle():
  found = cycles(graph())
  assert not found, "import cycles (a module reaching itself): " + "; ".join(
      " <-> ".join(c) for c in found)


def test_no_import_from_a_lower_floor_to_a_higher_one():
  bad = []
  for m, imported in sorted(graph().items()):
    for dep, line in sorted(imported.items()):
      if dep in ("experiments", "tests", "scripts"):
        bad.append(f"{_rel(m)}:{line} imports {dep} (the library imports no experiment, test "
                   "or script)")
      elif floor_of(dep) > floor_of(m):
        bad.append(f"{_rel(m)}:{line} ({FLOORS[floor_of(m)][0]}) imports {dep} "
                   f"({FLOORS[floor_of(dep)][0]})")
  assert not bad, "imports from a lower floor to a higher one:\n" + "\n".join(bad)


def test_design_doc_draws_these_floors():
  """docs/design.md names every floor, lowest first, in its drawing of the import floors."""
  text = open(os.path.join(ROOT, "docs", "design.md")).read()
  start = text.index("### Import floors")
  drawing = text[start:text.index("```", text.index("```", start) + 3)]
  at = [drawing.find(f"{name:<12}|") for name, _ in FLOORS]
  assert all(i >= 0 for i in at), [name for (name, _), i in zip(FLOORS, at) if i < 0]
  assert at == sorted(at, reverse=True), "the drawing lists the floors top (entry) to bottom"
  for name, prefixes in FLOORS:
    line = drawing[drawing.find(f"{name:<12}|"):].split("\n")[0]
    for p in prefixes:
      short = p.split(".", 1)[1] if p.startswith("distca_jax.") else p
      assert short in line, f"docs/design.md's floor {name!r} does not name {short}"


if __name__ == "__main__":
  g = graph()
  for m in sorted(g, key=lambda m: (floor_of(m) if floor_of(m) is not None else 99, m)):
    f = floor_of(m)
    print(f"{FLOORS[f][0] if f is not None and f >= 0 else '-':<11} {m} -> "
          + ", ".join(sorted(g[m])))
  for c in cycles(g):
    print("cycle:", " <-> ".join(c))
  sys.exit(1 if cycles(g) else 0)
