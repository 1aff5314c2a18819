"""Build script.

The package is pure Python (Triton kernels compile at run time). The compiled backends of csrc/ are
built just in time on first use, or here through torch.utils.cpp_extension (ninja) when asked:

    SPECDEC_BUILD_CPU=1 pip install --no-build-isolation -e .       # backend="cpu" (OpenMP)
    SPECDEC_BUILD_CUDA=1 pip install --no-build-isolation -e .      # backend="cuda"; needs nvcc / CUDA_HOME
    TORCH_CUDA_ARCH_LIST="8.0;9.0" (default) MAX_JOBS=8 ...          # targets, parallel jobs

Otherwise nothing is compiled and torch is not even imported at build time. Sources and flags of
both builds are declared once, in csrc/build.json (the just-in-time loader reads it too).
"""

import json
import os
import sys

from setuptools import setup

CSRC = "csrc"
BUILD = json.loads(open(os.path.join(CSRC, "build.json")).read())


def _asked(variable: str) -> bool:
    return os.environ.get(variable, "0") not in ("", "0")


def _torch_extension_tools():
    """torch.utils.cpp_extension, or None (with a message) when torch is not importable."""
    try:
        import torch  # noqa: F401
        from torch.utils import cpp_extension
    except ImportError as exc:
        print(
            f"specdec_kernels: torch is not importable ({exc}); use `pip install --no-build-isolation`. "
            "Building without compiled backends.",
            file=sys.stderr,
        )
        return None
    return cpp_extension


def _cpu_extensions():
    if not _asked("SPECDEC_BUILD_CPU"):
        return []
    tools = _torch_extension_tools()
    if tools is None:
        return []
    build = BUILD["cpu"]
    return [
        tools.CppExtension(
            name="specdec_kernels._csrc_cpu",
            sources=[os.path.join(CSRC, s) for s in build["sources"]],
            include_dirs=[os.path.abspath(CSRC)],
            extra_compile_args=build["cflags"],
            extra_link_args=build.get("ldflags", []),
        )
    ]


def _cuda_extensions():
    if not _asked("SPECDEC_BUILD_CUDA"):
        return []
    tools = _torch_extension_tools()
    if tools is None:
        return []
    import torch

    cuda_home = tools.CUDA_HOME
    if torch.version.cuda is None or cuda_home is None:
        print(
            f"specdec_kernels: SPECDEC_BUILD_CUDA=1 but no CUDA toolchain (torch.version.cuda={torch.version.cuda}, "
            f"CUDA_HOME={cuda_home}). Building without the CUDA backend.",
            file=sys.stderr,
        )
        return []
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")  # read by CUDAExtension; MAX_JOBS by ninja
    build = BUILD["cuda"]
    return [
        tools.CUDAExtension(
            name="specdec_kernels._csrc_cuda",
            sources=[os.path.join(CSRC, s) for s in build["sources"]],
            include_dirs=[os.path.abspath(CSRC)],
            extra_compile_args={"cxx": build["cflags"], "nvcc": build["cuda_cflags"]},
            extra_link_args=build.get("ldflags", []),
        )
    ]


ext_modules = _cpu_extensions() + _cuda_extensions()
cmdclass = {}
if ext_modules:
    from torch.utils.cpp_extension import BuildExtension

    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}
setup(ext_modules=ext_modules, cmdclass=cmdclass)
