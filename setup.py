"""Package mapping: ``planner/`` and ``kernels/`` install as ``rheoplan.planner`` and
``rheoplan.kernels`` (a top-level ``kernels`` would collide with Hugging Face's
``kernels`` package). Everything else lives in pyproject.toml."""

from setuptools import find_packages, setup

ROOTS = {"rheoplan": "rheoplan", "rheoplan.planner": "planner", "rheoplan.kernels": "kernels"}

packages = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=dict(ROOTS),
      package_data={"rheoplan": ["assets/**/*", "data/**/*"]})
