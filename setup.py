"""Package discovery for atom (all other configuration is in pyproject.toml).

`atom/` is found as-is; `dp/`, `kernels/` and `launch/` are mapped to `atom.dp`,
`atom.kernels` and `atom.launch` by `[tool.setuptools] package-dir` in pyproject.toml.
Subpackages (any folder with an __init__.py) under each root are picked up automatically.
"""

from setuptools import find_packages, setup

ROOTS = {"atom": "atom", "atom.dp": "dp", "atom.kernels": "kernels", "atom.launch": "launch"}

packages = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [
        f"{name}.{sub}" for sub in find_packages(where=folder, exclude=["tests", "tests.*"])
    ]

setup(packages=sorted(set(packages)))
