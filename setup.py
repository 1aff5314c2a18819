"""Build script.

The package is pure Python (Triton kernels compile at run time). The optional CUDA backend in
csrc/ (``backend="cuda"``) is compiled here through torch.utils.cpp_extension (CUDAExtension, ninja)
only when ``SPECDEC_BUILD_CUDA=1`` *and* a CUDA toolchain is present (torch built with CUDA, nvcc /
CUDA_HOME found). Otherwise nothing is compiled and torch is not even imported at build time, so a
CPU-only install stays pure Python. The backend can also be compiled just in time on first use.

    SPECDEC_BUILD_CUDA=1 pip install --no-build-isolation -e .      # torch must be importable
    TORCH_CUDA_ARCH_LIST="8.0;9.0" (default) MAX_JOBS=8 ...          # targets, parallel jobs
"""

import os
import sys

from setuptools import setup

CSRC = "csrc"
SOURCES = ["binding.cpp", "verify_cpu.cpp", "verify_cuda.cu"]


def _cuda_extensions():
    """([CUDAExtension], cmdclass) when asked for and possible, else ([], {})."""
    if os.environ.get("SPECDEC_BUILD_CUDA", "0") in ("", "0"):
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as exc:
        print(
            f"specdec_kernels: SPECDEC_BUILD_CUDA=1 but torch is not importable ({exc}); "
            "use `pip install --no-build-isolation`. Building without the CUDA backend.",
            file=sys.stderr,
        )
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        print(
            f"specdec_kernels: SPECDEC_BUILD_CUDA=1 but no CUDA toolchain (torch.version.cuda={torch.version.cuda}, "
            f"CUDA_HOME={CUDA_HOME}). Building without the CUDA backend.",
            file=sys.stderr,
        )
        return [], {}
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")  # read by CUDAExtension; MAX_JOBS by ninja
    flags = ["-O3", "-DSPECDEC_WITH_CUDA"]
    ext = CUDAExtension(
        name="specdec_kernels._csrc_cuda",
        sources=[os.path.join(CSRC, s) for s in SOURCES],
        include_dirs=[os.path.abspath(CSRC)],
        extra_compile_args={"cxx": flags, "nvcc": flags + ["-lineinfo"]},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _cuda_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
