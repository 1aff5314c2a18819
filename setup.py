"""Build script.

The package is pure Python (Triton kernels compile at run time). The optional CUDA backend in
csrc/ will be built here through torch.utils.cpp_extension only when SPECDEC_BUILD_CUDA=1, so a
CPU-only install never imports torch at build time nor tries to compile.
"""

from setuptools import setup

setup()
