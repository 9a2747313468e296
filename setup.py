# The native modules are built by cffi during `pip install`; metadata lives in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["rings/_build.py:ffibuilder", "virtio/_build.py:ffibuilder", "vhost/_build.py:ffibuilder"])
