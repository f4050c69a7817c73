"""The import graph points down (docs/design.md, "The import graph, as built"): every module's imports, lazy ones
included, read with `ast`; no cycle, and no edge up or sideways between packages. A failure names both files."""

import ast
import functools
import importlib.metadata
import os
import sys
import tomllib

import pytest

from tests.helpers import ROOT, requirement_name

SCANNED = ("pallas_kernels", "glm_jax", "experiments")  # configs/ and launch/ link into glm_jax

# Group (the longest matching module prefix) -> rank. An import must stay inside its group or go to a lower rank.
RANKS = {
  "pallas_kernels": 0,
  "glm_jax": 1,
  "glm_jax.tree_paths": 1,
  "glm_jax.mesh_axes": 1,
  "glm_jax.strict_json": 1,  # leaf modules, by name
  "glm_jax.chat": 1,  # GLM-5's chat format (stdlib only)
  "glm_jax.paths": 0,  # untrusted files and paths (stdlib only): what every reader and writer of them uses
  "glm_jax.plots": 1,
  "glm_jax.quant": 1,  # the quantizer: the model's matmuls take its packed weights
  "glm_jax.model": 2,
  "glm_jax.data": 2,
  "glm_jax.sharding": 2,
  "glm_jax.convert": 3,
  "glm_jax.inference": 3,
  "glm_jax.train": 3,
  "glm_jax.serving": 4,  # the serving engine (inference's model steps over a paged cache) and its HTTP server
  "glm_jax.rl": 5,  # its rollouts may run on the serving engine
  "glm_jax.cli": 5,  # the launch scripts' error handling (reads train.guards)
  "glm_jax.sweep": 6,  # checks each point's config with the pretraining and RL trainers' checks
  "glm_jax.restore": 6,  # any run's weights, config and tokenizer (the RL tasks' vocabulary among them)
  "glm_jax.launch": 7,  # the entry points (launch/ links here)
  "experiments": 7,
}
EXACT = {"glm_jax"}  # groups of one module: a new glm_jax subpackage or leaf module must be ranked here
CONFIGS = "glm_jax.configs"  # experiment files: only entry points import them, and they import each other and these:
# the library's default sections (glm_jax/configs/common.py)
CONFIG_IMPORTS = {
  "glm_jax.data.config",
  "glm_jax.sharding.mesh",
  "glm_jax.train.config",
  "glm_jax.train.optimizer_config",
  "glm_jax.model.quantization",
  "glm_jax.model.config",
  "glm_jax.rl.config",
}


def module_files(root: str = ROOT) -> dict[str, str]:
  """{dotted module name: path relative to root} for every .py file of the scanned folders."""
  out = {}
  for top in SCANNED:
    for folder, dirs, files in os.walk(os.path.join(root, top)):
      dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
      for name in sorted(f for f in files if f.endswith(".py")):
        rel = os.path.relpath(os.path.join(folder, name), root)
        parts = rel[:-3].split(os.sep)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = rel
  return out


def imports_of(module: str, source: str, known: set[str], is_package: bool = False) -> set[str]:
  """The known modules `module` (a package's __init__ when is_package) imports anywhere in `source`, function
  bodies too. `from pkg import name` is an edge to pkg.name when that is a module, else to pkg."""
  found = set()
  tree = ast.parse(source)
  for node in ast.walk(tree):
    for target in import_targets(node, module, known, is_package):
      while target and target not in known:  # `import glm_jax.model.mla as m` -> the module itself
        target = target.rpartition(".")[0]
      if target and target != module:
        found.add(target)
  return found


def import_targets(node, module: str, known, is_package: bool) -> list[str]:
  """The modules an import statement `node` of `module` names ([] for any other node): `from pkg import name` names
  pkg.name when that is in `known`, else pkg; a relative import is resolved against the module's package."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names]
  if not isinstance(node, ast.ImportFrom):
    return []
  base = node.module or ""
  if node.level:
    package = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    base = ".".join(package + ([base] if base else []))
  return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def group_of(module: str) -> str:
  if module == CONFIGS or module.startswith(CONFIGS + "."):
    return CONFIGS
  matches = [g for g in RANKS if module == g or (g not in EXACT and module.startswith(g + "."))]
  if not matches:
    raise ValueError(f"module {module} belongs to no group of RANKS; add its package there")
  return max(matches, key=len)


def layering_violations(edges: dict[str, set[str]], files: dict[str, str]) -> list[str]:
  out = []
  for src in sorted(edges):
    for dst in sorted(edges[src]):
      gs, gd = group_of(src), group_of(dst)
      if gs == gd:
        continue
      if gs == CONFIGS:
        why = None if dst in CONFIG_IMPORTS else "configs import only configs and the library's default sections"
      elif gd == CONFIGS:
        why = None if RANKS[gs] == max(RANKS.values()) else "only entry points (launch, experiments) import configs"
      elif RANKS[gd] < RANKS[gs]:
        why = None
      else:
        way = "sideways" if RANKS[gd] == RANKS[gs] else "upward"
        why = f"{way}: {gs} (rank {RANKS[gs]}) may not import {gd} (rank {RANKS[gd]})"
      if why:
        out.append(f"{files[src]} imports {files[dst]}: {why}")
  return out


def cycles(edges: dict[str, set[str]], files: dict[str, str]) -> list[str]:
  """One line per cycle found by a depth-first search: a -> b -> ... -> a, as file paths."""
  found, state, stack = [], {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(edges.get(node, ())):
      if state.get(nxt) == "open":
        loop = stack[stack.index(nxt) :] + [nxt]
        found.append(" -> ".join(files[m] for m in loop))
      elif nxt not in state:
        visit(nxt)
    stack.pop()
    state[node] = "done"

  for node in sorted(edges):
    if node not in state:
      visit(node)
  return found


def import_graph(root: str = ROOT) -> tuple[dict[str, set[str]], dict[str, str]]:
  files = module_files(root)
  known = set(files)
  edges = {}
  for module, rel in files.items():
    with open(os.path.join(root, rel), encoding="utf-8") as f:
      edges[module] = imports_of(module, f.read(), known, is_package=rel.endswith("__init__.py"))
  return edges, files


def test_the_package_imports_only_downward_without_cycles():
  edges, files = import_graph()
  assert len(files) > 50 and sum(map(len, edges.values())) > 100  # the scan found the code
  problems = layering_violations(edges, files) + [f"cycle: {c}" for c in cycles(edges, files)]
  assert not problems, "\n".join(problems)


def test_the_checker_finds_cycles_upward_and_sideways_edges(tmp_path):
  """The rules on a small tree written here, with one of each fault, so the test above cannot pass vacuously."""
  sources = {
    "pallas_kernels/__init__.py": "",
    "pallas_kernels/k.py": "",
    "glm_jax/__init__.py": "",
    "glm_jax/tree_paths.py": "import pallas_kernels.k\n",
    "glm_jax/model/__init__.py": "",
    "glm_jax/model/a.py": "from glm_jax.model import b\n",
    "glm_jax/model/b.py": "def f():\n  from glm_jax.model.a import x  # lazy, still an edge\n",
    "glm_jax/data/__init__.py": "from glm_jax.model import a\n",  # sideways
    "glm_jax/train/__init__.py": "from glm_jax import tree_paths\nfrom glm_jax.rl import loop\n",  # upward
    "glm_jax/rl/__init__.py": "",
    "glm_jax/rl/loop.py": "from glm_jax.train import x\nimport glm_jax.configs.c\n",  # configs from a library module
    "glm_jax/configs/__init__.py": "",
    "glm_jax/configs/c.py": "from glm_jax.configs import d\nfrom glm_jax.train.config import default_train_config\n",
    "glm_jax/configs/d.py": "from glm_jax.model import a\n",  # a config reaching into the model
    "glm_jax/train/config.py": "",
    "glm_jax/launch/__init__.py": "",
    "glm_jax/launch/run.py": "from glm_jax.configs import c\nfrom glm_jax.rl import loop\n",
  }
  for rel, text in sources.items():
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  edges, files = import_graph(str(tmp_path))
  assert edges["glm_jax.model.b"] == {"glm_jax.model.a"} and edges["glm_jax.tree_paths"] == {"pallas_kernels.k"}
  assert layering_violations(edges, files) == [
    "glm_jax/configs/d.py imports glm_jax/model/a.py: configs import only configs and the library's default sections",
    "glm_jax/data/__init__.py imports glm_jax/model/a.py: sideways: glm_jax.data (rank 2) may not import "
    "glm_jax.model (rank 2)",
    "glm_jax/rl/loop.py imports glm_jax/configs/c.py: only entry points (launch, experiments) import configs",
    "glm_jax/train/__init__.py imports glm_jax/rl/loop.py: upward: glm_jax.train (rank 3) may not import "
    "glm_jax.rl (rank 5)",
  ]
  assert cycles(edges, files) == [
    "glm_jax/model/a.py -> glm_jax/model/b.py -> glm_jax/model/a.py",
    "glm_jax/rl/loop.py -> glm_jax/train/__init__.py -> glm_jax/rl/loop.py",
  ]


def test_an_unranked_package_is_an_error():
  for module in ("glm_jax_extra.x", "glm_jax.new_leaf", "glm_jax.newpkg.module"):
    with pytest.raises(ValueError, match=f"{module} belongs to no group"):
      group_of(module)


def third_party_imports(files: dict[str, str], root: str = ROOT) -> dict[str, str]:
  """{top-level module: a file importing it} for every module outside the standard library and this repository
  that `files` import, lazy imports included."""
  out = {}
  for rel in files.values():
    for node in ast.walk(ast.parse(open(os.path.join(root, rel)).read())):
      names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
      if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
      for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"glm_jax", "pallas_kernels"}:
        out.setdefault(top, rel)
  return out


def _declared() -> tuple[set[str], dict[str, set[str]]]:
  """pyproject.toml's dependencies and its extras (but `test`), as normalized distribution names."""
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  extras = {k: {requirement_name(r) for r in v} for k, v in project["optional-dependencies"].items() if k != "test"}
  return {requirement_name(r) for r in project["dependencies"]}, extras


@functools.cache
def _installed() -> dict[str, list[str]]:
  return importlib.metadata.packages_distributions()


def _distributions(module: str) -> set[str]:
  return {d.lower().replace("_", "-") for d in _installed().get(module, [module])}


def test_every_third_party_import_of_the_package_is_declared():
  """What a `pip install` of glm-jax with all its extras installs holds every module the package imports, lazy
  imports included: a module only a test requirement held (httpx, once) fails a user's install while the suite,
  which has the test extra, passes."""
  core, extras = _declared()
  declared = core.union(*extras.values())
  package = {m: rel for m, rel in module_files().items() if m.startswith(("glm_jax", "pallas_kernels"))}
  missing = {m: rel for m, rel in third_party_imports(package).items() if not _distributions(m) & declared}
  assert not missing, (
    f"imported but in no dependency or extra of pyproject.toml (module: a file importing it): {missing}"
  )


def eager_imports(module: str, files: dict[str, str]) -> set[str]:
  """The modules `module` imports when it is imported: its module-level imports (class bodies too, function bodies
  not), their packages' __init__s, and theirs in turn; third-party ones as top-level names."""
  seen, todo, third_party = set(), [module], set()
  while todo:
    m = todo.pop()
    parts = m.split(".")
    for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
      name = ".".join(parts[:i])
      if name in seen or name not in files:
        continue
      seen.add(name)
      tree = ast.parse(open(os.path.join(ROOT, files[name])).read())
      is_package = files[name].endswith("__init__.py")
      for node in _module_level(tree):
        for t in import_targets(node, name, files, is_package):
          if t.split(".")[0] in ("glm_jax", "pallas_kernels"):
            todo.append(t)
          elif t.split(".")[0] not in sys.stdlib_module_names:
            third_party.add(t.split(".")[0])
  return third_party


def _module_level(tree):
  """The nodes of `tree` that run when the module is imported: all but those inside function bodies."""
  todo = list(tree.body)
  while todo:
    node = todo.pop()
    yield node
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      todo.extend(ast.iter_child_nodes(node))


def test_training_and_sampling_import_only_the_core_dependencies():
  """`pip install glm-jax` without extras runs the entry points of training, sampling, conversion and AOT compiles:
  what they import at start-up is in pyproject.toml's dependencies; an extra's module (the HTTP server, plots) is
  imported where its feature is used."""
  core, extras = _declared()
  files = module_files()
  for entry in (
    "glm_jax.launch.train",
    "glm_jax.launch.sample",
    "glm_jax.launch.quantize",
    "glm_jax.launch.convert",
    "glm_jax.launch.compile",
    "glm_jax.launch.model_info",
  ):
    outside = {m for m in eager_imports(entry, files) if not _distributions(m) & core}
    assert not outside, f"{entry} imports {outside} at start-up; they are not core dependencies"
  # and the check sees an extra's import where there is one
  assert "fastapi" in eager_imports("glm_jax.serving.server", files)
  assert "matplotlib" in eager_imports("glm_jax.plots", files) and "matplotlib" in extras["plots"]
