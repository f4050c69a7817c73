"""Fixtures shared by the test packages (helpers that are not fixtures: tests/helpers.py; the data tests'
own fixtures: tests/data/conftest.py)."""

import gc
import json
import os

# On CPU the suite compiles fast: LLVM without optimizations (XLA's backend optimization level 0; its default is 3),
# set here before jax starts and inherited by the subprocesses and notebook kernels the tests start: most of the
# suite's time is compiling programs that then run a few steps. The programs compute the same functions, rounded
# otherwise; a test whose tolerance is derived for the default compilation asks for it (tests/helpers.py:
# DEFAULT_COMPILE). Measurements: docs/testing.md, "Compiling on a CPU".
if os.environ.get("JAX_PLATFORMS") == "cpu":
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_backend_optimization_level" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

from tests import shared_runs
from tests.helpers import persistent_compilation_cache

# The tests compare float32 computations with numpy, torch or a second formula at float32 tolerances. On a GPU, XLA
# runs float32 matmuls in TF32 (10 mantissa bits) by default, which moves results by about 1e-3 relative; the tests
# ask for true float32 there (on CPU, the suite's machine, this changes nothing: float32 dots are float32).
if jax.default_backend() == "gpu":
  jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def data_cache_dir(tmp_path_factory):
  """A data cache (config.data.cache_dir) for the tests that train on the embedded corpus: its BPE and tokenized
  corpus are built once per test process, and never in the user's ~/.cache."""
  return str(tmp_path_factory.mktemp("data_cache"))


@pytest.fixture(autouse=True, scope="session")
def shared_compilation_cache(tmp_path_factory):
  """One persistent compilation cache for the whole suite, in this process and in the subprocesses and notebook
  kernels it starts (through the environment), shared by pytest-xdist's workers: a program is compiled once and its
  executable reused as is wherever it recurs (the short glm5_tiny runs of the trainer, fault and sweep tests, the RL
  loops and the notebooks, the resumed runs, and the eager initialization ops every file that builds a model
  compiles again after release_compiled_programs below drops the in-memory caches)."""
  base = tmp_path_factory.getbasetemp()
  root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  path = os.path.join(str(root), "jax_cache")
  os.makedirs(path, exist_ok=True)
  with persistent_compilation_cache(path):
    yield path


@pytest.fixture(autouse=True)
def no_persistent_cache_for_tpu_compiles(request, shared_compilation_cache):
  """A test marked tpu_compile compiles without the persistent cache, here and in the processes it starts: a TPU
  executable compiled through a topology description cannot be loaded back (the compile-only client cannot
  deserialize it), so writing it costs the key's hash and the serialization for nothing, and a second compile of
  the program warns that it could not read the entry."""
  if request.node.get_closest_marker("tpu_compile") is None:
    yield
    return
  saved, enabled = os.environ.get("JAX_ENABLE_COMPILATION_CACHE"), jax.config.jax_enable_compilation_cache
  os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()  # is_cache_used() keeps its first answer until reset
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()
    if saved is None:
      os.environ.pop("JAX_ENABLE_COMPILATION_CACHE")
    else:
      os.environ["JAX_ENABLE_COMPILATION_CACHE"] = saved


@pytest.fixture(scope="session")
def glm5_tiny_run(tmp_path_factory, data_cache_dir):
  """(workdir, summary) of the session's shared glm5_tiny run (tests/shared_runs.py; copy it before writing into
  it): launch/train.py as a user runs it, 9 steps of 4 x 64 tokens (tests/train/runs.py), every step logged,
  checkpoints at 1, 3, 6 and 9 all kept, its stdout in stdout.txt."""
  from tests.train import runs

  def make(workdir):
    proc = runs.run_train(workdir, data_cache_dir, **runs.KEEP_ALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(workdir, "stdout.txt"), "w") as f:
      f.write(proc.stdout)

  workdir = shared_runs.shared_run(tmp_path_factory, "glm5_tiny_9_steps", make)
  with open(os.path.join(workdir, "stdout.txt")) as f:
    return workdir, json.loads(f.read().strip().splitlines()[-1])


@pytest.fixture(autouse=True, scope="session")
def verify_shared_runs():
  """At the end of the session: the shared runs (tests/shared_runs.py) this process handed out are as they were made."""
  yield
  problems = shared_runs.changed_runs()
  assert not problems, "\n".join(problems)


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
  """Drops the compiled programs and traces of a test file when it ends. Without it a worker keeps every file's
  executables to the end of the suite (8 GB a worker on this 2-core, 24 GB machine), and the page cache thrashes."""
  yield
  jax.clear_caches()
  gc.collect()


# The files that take longest (minutes each: the 8-device session is one subprocess of several minutes), in the
# order they start. pytest-xdist's --dist loadfile hands files to the workers in the order of its work queue; by
# default it sorts that queue by the number of tests a file has, which put the 8-device session (two tests) last,
# where it ran alone for 7 minutes while the other worker idled. Here the queue is the collection order (the
# reorder is switched off below), and the collection order is these files first, then the others by their number of
# tests (xdist's own heuristic), so the short files fill in at the end.
LONG_FILES = (
  "tests/test_multi_device.py",
  "tests/test_notebooks.py",
  "tests/rl/test_trainer.py",
  "tests/train/test_faults.py",
  "tests/train/test_aot.py",
  "tests/sharding/test_hlo_cost.py",
  "tests/quant/test_model_quant.py",
  "tests/sharding/test_context_parallel.py",
  "tests/test_sweep.py",
  "tests/train/test_lifecycle.py",
  "tests/rl/test_agentic.py",
  "tests/rl/test_rollout_engine.py",
  "tests/rl/test_agent_loop.py",
)


def pytest_addoption(parser):
  parser.addoption(
    "--maintainer",
    action="store_true",
    help="also run the tests marked maintainer (every notebook end to end), which CI leaves out",
  )


def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's --dist loadfile: keep the collection's order
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
  if not config.getoption("--maintainer"):
    skip = pytest.mark.skip(reason="a maintainer's test: run with --maintainer")
    for item in items:
      if "maintainer" in item.keywords:
        item.add_marker(skip)
  root = os.path.dirname(os.path.dirname(__file__))
  files = [os.path.relpath(str(item.path), root) for item in items]
  count = {f: files.count(f) for f in set(files)}
  first = {f: files.index(f) for f in set(files)}

  def order(pair):
    f = pair[1]
    return (LONG_FILES.index(f) if f in LONG_FILES else len(LONG_FILES), -count[f], first[f])

  items[:] = [item for item, _ in sorted(zip(items, files), key=order)]  # a file's tests keep their order


def pytest_collection_finish(session):
  """Moves every object alive after collection (the imported modules of jax, flax, torch, transformers: about half a
  million) out of the garbage collector's reach (gc.freeze): a full collection, which Python runs every few thousand
  allocations and release_compiled_programs runs after each file, then walks only what the tests made, not all of
  them again each time. They would live to the end of the session anyway."""
  gc.collect()
  gc.freeze()
