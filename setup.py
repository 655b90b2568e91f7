"""Package discovery (the rest of the metadata is in pyproject.toml).

Every package under `fastrl/` is found, whatever is added later (a hand-written list once missed
`fastrl.train`), and the top-level `kernels/` folder installs as `fastrl.kernels`, never as a
top-level `kernels` package (that name belongs to another project that transformers probes for).
"""

from setuptools import find_namespace_packages, setup

EXCLUDE = ["*__pycache__*"]
fastrl_packages = find_namespace_packages(include=["fastrl", "fastrl.*"], exclude=EXCLUDE)
kernel_packages = ["fastrl.kernels"] + [
    f"fastrl.kernels.{p}" for p in find_namespace_packages(where="kernels", exclude=EXCLUDE)
]

setup(
    packages=fastrl_packages + kernel_packages,
    package_dir={"fastrl.kernels": "kernels"},
)
