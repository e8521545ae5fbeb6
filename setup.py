"""Build configuration that pyproject.toml cannot say: the run-time data folders.

``patches/`` (recipes) and ``specs/`` (the demo's spec among them) stay at the top of the
repository, as the layout says; the wheel carries them inside the package as
``surgeon/_data/patches`` and ``surgeon/_data/specs``, where :mod:`surgeon.core.data` finds them
with importlib.resources (a checkout reads the top-level folders themselves).
"""

from setuptools import find_packages, setup

DATA = {"surgeon._data.patches": "patches", "surgeon._data.specs": "specs"}

setup(
    packages=[*find_packages(include=["surgeon", "surgeon.*"]), *DATA],
    package_dir=DATA,
    package_data={"surgeon._data.patches": ["*.yaml", "*.md"], "surgeon._data.specs": ["*.yaml"]},
)
