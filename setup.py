"""Dependencies come from requirements.txt (runtime) and the extras: `test` (requirements-test.txt), `tpu`
(requirements-tpu.txt: libtpu, to compile for TPU topologies on any host, or to run on a TPU VM) and `tensorboard`
(the TensorBoard viewer for a run's <workdir>/tensorboard; the runs write its files without it)."""

import pathlib

from setuptools import setup

HERE = pathlib.Path(__file__).parent


def requirements(name: str) -> list[str]:
  lines = (HERE / name).read_text().splitlines()
  return [l.split("#")[0].strip() for l in lines if l.split("#")[0].strip() and not l.startswith("-r")]


setup(
  install_requires=requirements("requirements.txt"),
  extras_require={
    "test": requirements("requirements-test.txt"),
    "tpu": requirements("requirements-tpu.txt"),
    "tensorboard": ["tensorboard>=2.16,<3"],
  },
)
