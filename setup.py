"""Dependencies come from requirements.txt (runtime) and requirements-test.txt (the `test` extra)."""

import pathlib

from setuptools import setup

HERE = pathlib.Path(__file__).parent


def requirements(name: str) -> list[str]:
  lines = (HERE / name).read_text().splitlines()
  return [l.split("#")[0].strip() for l in lines if l.split("#")[0].strip() and not l.startswith("-r")]


setup(install_requires=requirements("requirements.txt"), extras_require={"test": requirements("requirements-test.txt")})
