"""CUDA C sources of dpboard's kernels, installed as the package ``dpboard.cuda_sources``.

This file makes the folder a regular package, so that ``importlib.resources`` finds the sources in
editable installs as well as in wheels.
"""
