"""The package layout: host planning (distca_jax.plan) apart from the device data plane
(distca_jax.dataplane), no private names across library modules, no oversized library file."""

import ast
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = ("distca_jax", "custom_ops")
PACKAGES = LIBRARY + ("experiments",)  # whose private names stay inside their module
MAX_LINES = 800


def _rel(path: str) -> str:
  return os.path.relpath(path, ROOT)


def _library_files():
  return sorted(p for pkg in LIBRARY
                for p in glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True))


def _experiment_files():
  return sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py")))


def _package_files(name: str):
  return sorted(glob.glob(os.path.join(ROOT, "distca_jax", name, "*.py")))


def _module_name(path: str) -> str:
  rel = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path: str) -> list[tuple[str, list[str]]]:
  """(module, names) of every import in the file: names imported from it ([] for `import m`)."""
  tree = ast.parse(open(path).read(), path)
  me = _module_name(path)
  pkg = me if path.endswith("__init__.py") else me.rpartition(".")[0]
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.extend((a.name, []) for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      mod = node.module or ""
      if node.level:
        base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
        mod = ".".join(base + ([mod] if mod else []))
      out.append((mod, [a.name for a in node.names]))
  return out


def _in(module: str, package: str) -> bool:
  return module == package or module.startswith(package + ".")


def _imported_modules(path: str) -> set[str]:
  """Modules the file imports, counting `from pkg import mod` as an import of `pkg.mod`."""
  mods = set()
  for mod, names in _imports(path):
    mods.add(mod)
    mods.update(f"{mod}.{n}" for n in names)
  return mods


@pytest.mark.parametrize("path", _package_files("dataplane"), ids=_rel)
def test_dataplane_imports_no_data_pipeline(path):
  bad = sorted(m for m in _imported_modules(path) if _in(m, "distca_jax.data"))
  assert not bad, f"{os.path.relpath(path, ROOT)} imports the data pipeline: {bad}"


# matplotlib: `diagnostics.plot_loads` imports it when called (the runtime test below checks
# that importing the package loads no more than NumPy).
PLAN_MAY_IMPORT = ("numpy", "distca_jax.plan", "distca_jax.checks", "distca_jax.errors",
                   "matplotlib")


@pytest.mark.parametrize("path", _package_files("plan"), ids=_rel)
def test_plan_imports_only_numpy_and_the_project_checks(path):
  """The host planner is plain NumPy: besides the standard library it imports NumPy, itself and
  the project's checks and errors; no JAX, data pipeline, config, data plane or backend."""
  import sys as sys_lib
  bad = sorted(m for m in _imported_modules(path)
               if m.split(".")[0] not in sys_lib.stdlib_module_names
               and not any(_in(m, ok) for ok in PLAN_MAY_IMPORT))
  assert not bad, f"{_rel(path)} (host planning) imports {bad}"


def test_ops_imports_nothing_from_plan():
  """The kernel dispatch (ops) is below the planner: the planner counts a task table's pairs and
  FLOPs (plan.cost), ops runs the kernels."""
  path = os.path.join(ROOT, "distca_jax", "ops.py")
  bad = sorted(m for m in _imported_modules(path) if _in(m, "distca_jax.plan"))
  assert not bad, f"distca_jax/ops.py imports the planner: {bad}"


def test_import_graph_at_runtime():
  """Importing the planner loads neither jax nor the data pipeline nor the kernels; importing the
  data plane does not load the data pipeline (transitively, not only by direct imports)."""
  code = ("import sys\n"
          "import distca_jax.plan\n"
          "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')\n"
          "             or m in ('distca_jax.data', 'distca_jax.ops', 'distca_jax.config'))\n"
          "assert not bad, f'distca_jax.plan loaded {bad}'\n"
          "import distca_jax.dataplane\n"
          "bad = sorted(m for m in sys.modules if m == 'distca_jax.data' or"
          " m.startswith('distca_jax.data.'))\n"
          "assert not bad, f'distca_jax.dataplane loaded {bad}'\n")
  run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert run.returncode == 0, run.stderr


def test_reading_backend_options_reads_no_data(monkeypatch):
  """``Options.from_config`` only reads the config: with caps and WLB-ideal left to the data,
  no batch is sampled and no plan is balanced until ``backends.build`` runs the startup step
  (``from_first_batches``)."""
  from distca_jax import backends, configs_io, data
  from distca_jax.backends import distca as distca_backend
  from distca_jax.plan import balancer
  c = configs_io.load_config(os.path.join(ROOT, "configs", "tiny_cpu.py"))
  c.attention.distca.caps_from_batches = 2
  c.attention.baselines.cp_size = c.attention.baselines.wlb_alpha = 0
  sampled = []
  real = data.make_source

  def counted(*args, **kwargs):
    sampled.append(1)
    return real(*args, **kwargs)

  # Every backend reads the run's batches through data.run_source, which calls this.
  monkeypatch.setattr(data, "make_source", counted)
  balanced = []
  real_init = balancer.Balancer.__init__

  def counted_init(self, *args, **kwargs):  # every plan (plan.schedule) builds one Balancer
    balanced.append(1)
    real_init(self, *args, **kwargs)

  monkeypatch.setattr(balancer.Balancer, "__init__", counted_init)
  for name in backends.BACKENDS:
    c.attention.backend = name
    backends.module(name).Options.from_config(c)
  assert not sampled, "reading a backend's options sampled batches"
  assert not balanced, "reading a backend's options ran the planner"
  options = distca_backend.Options.from_config(c)
  assert all(v == 0 for v in options.caps.values()), options.caps
  c.attention.backend = "distca"
  built = backends.build(c)
  assert sampled and balanced and any(built.caps[f] for f in ("q_send", "q_tokens")), built.caps


@pytest.mark.parametrize("path", _library_files() + _experiment_files(), ids=_rel)
def test_no_private_name_across_library_modules(path):
  """`from distca_jax.x import _name` and `x._name` (x an imported library or experiments
  module) only inside the module that defines `_name`: experiments use the public API too."""
  me = _module_name(path)
  tree = ast.parse(open(path).read(), path)
  aliases = {}  # local name -> library module
  bad = []
  for mod, names in _imports(path):
    if not any(_in(mod, p) for p in PACKAGES):
      continue
    for n in names:
      if n.startswith("_") and mod != me:
        bad.append(f"from {mod} import {n}")
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if any(_in(a.name, p) for p in PACKAGES):
          aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.module and any(_in(node.module, p)
                                                                 for p in PACKAGES):
      for a in node.names:
        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
        and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
        and node.value.id in aliases and aliases[node.value.id] != me):
      bad.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
  assert not bad, f"{os.path.relpath(path, ROOT)} uses private names of other modules: {bad}"


@pytest.mark.parametrize("path", _experiment_files(), ids=_rel)
def test_experiments_import_as_a_package(path):
  """Experiments run as `python -m experiments.<name>` from the repository root: none edits
  sys.path to find the library or a sibling experiment."""
  with open(path) as f:
    assert "sys.path" not in f.read(), f"{_rel(path)} edits sys.path; import it as a package"


@pytest.mark.parametrize("path", _library_files(), ids=_rel)
def test_library_files_are_short(path):
  with open(path) as f:
    n = sum(1 for _ in f)
  assert n <= MAX_LINES, (f"{os.path.relpath(path, ROOT)} has {n} lines > {MAX_LINES}; split it "
                          "along a seam")


def test_old_modules_are_gone():
  for old in ("scheduler", "dispatch"):
    assert not os.path.exists(os.path.join(ROOT, "distca_jax", f"{old}.py"))


def test_every_backend_module_exports_options_and_make():
  """One registry: each backend module has a frozen ``Options`` with ``from_config`` and a
  ``make(options) -> attention.Backend``; ``backends.build`` turns every name of a shipped config
  into a backend, and the trainer names no backend."""
  import dataclasses
  import inspect

  from distca_jax import attention, backends, configs_io, trainer
  c = configs_io.load_config(os.path.join(ROOT, "configs", "tiny_cpu.py"))
  c.attention.distca.caps_from_batches = 2
  assert set(backends.BACKENDS) == {"local", "reference", "distca", "packed_dp", "cp", "wlb"}
  for name, m in backends.BACKENDS.items():
    assert dataclasses.is_dataclass(m.Options) and m.Options.__dataclass_params__.frozen, name
    c.attention.backend = name
    options = m.Options.from_config(c)
    assert isinstance(options, m.Options), name
    assert isinstance(backends.build(c), attention.Backend), name
    # Options left to the data (0: cp / wlb configuration, distca caps) are resolved by the
    # startup step before make.
    if hasattr(m, "from_first_batches"):
      options = m.from_first_batches(c, options)
    assert isinstance(m.make(options), attention.Backend), name
  with pytest.raises(ValueError, match=r"available: .*distca"):
    backends.module("nope")
  source = inspect.getsource(trainer)
  for name in backends.BACKENDS:
    assert f'"{name}"' not in source and f"'{name}'" not in source, name


def test_kernel_and_backend_registries_have_their_own_names():
  """A kernel (one fused core-attention call: ``ops.KERNELS``) and a backend (a strategy of the
  trainer: ``backends.BACKENDS``) never share a registry name: each registry is assigned at the
  top level of exactly one library module, and ops defines no backend registry."""
  where = {"KERNELS": [], "BACKENDS": []}
  for path in _library_files():
    for node in ast.parse(open(path).read(), path).body:
      targets = (node.targets if isinstance(node, ast.Assign)
                 else [node.target] if isinstance(node, ast.AnnAssign) else [])
      for t in targets:
        if isinstance(t, ast.Name) and t.id in where:
          where[t.id].append(_rel(path))
  assert where == {"KERNELS": [os.path.join("distca_jax", "ops.py")],
                   "BACKENDS": [os.path.join("distca_jax", "backends", "__init__.py")]}, where
  from distca_jax import backends, ops
  assert not hasattr(ops, "BACKENDS") and not hasattr(backends, "KERNELS")
  assert set(backends.BACKENDS) >= {"local", "distca"} and set(ops.KERNELS) >= {"blockwise", "auto"}
