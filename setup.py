"""Build script.

The package is pure Python (Triton kernels compile at run time). The compiled backends of csrc/ are
built just in time on first use, or here through torch.utils.cpp_extension (ninja) when asked:

    SPECDEC_BUILD_CPU=1 pip install --no-build-isolation -e .       # backend="cpu" (OpenMP)
    SPECDEC_BUILD_CUDA=1 pip install --no-build-isolation -e .      # backend="cuda"; needs nvcc / CUDA_HOME
    TORCH_CUDA_ARCH_LIST="8.0;9.0" (default) MAX_JOBS=8 ...          # targets, parallel jobs

Both need torch importable at build time, hence --no-build-isolation (pip's isolated build
environment has no torch, and declaring it a build requirement would pull a CUDA torch into every
build); asked for without it, the build stops and says so. Otherwise nothing is compiled and torch is
not even imported at build time. Sources and flags of both builds are declared once, in
csrc/build.json (the just-in-time loader reads it too).

Wheels (and non-editable installs) carry the csrc sources as package data, specdec_kernels/csrc/,
so that an installed package can build its CPU / CUDA backend just in time; an editable install
reads the checkout's csrc/ instead.
"""

import glob
import json
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

CSRC = "csrc"
BUILD = json.loads(open(os.path.join(CSRC, "build.json")).read())
CSRC_FILES = ("*.h", "*.cuh", "*.cpp", "*.cu", "build.json")  # what the just-in-time builds read
PACKAGED_CSRC = os.path.join("specdec_kernels", "csrc")  # where a wheel carries them


class BuildPyWithCsrc(build_py):
    """build_py that also copies the csrc sources into the package (specdec_kernels/csrc/)."""

    def _csrc_copies(self) -> list[tuple[str, str]]:
        if getattr(self, "editable_mode", False):  # an editable install reads the checkout's csrc/
            return []
        names = sorted({os.path.basename(f) for pattern in CSRC_FILES for f in glob.glob(os.path.join(CSRC, pattern))})
        return [(os.path.join(CSRC, n), os.path.join(self.build_lib, PACKAGED_CSRC, n)) for n in names]

    def run(self):
        super().run()
        for source, target in self._csrc_copies():
            self.mkpath(os.path.dirname(target))
            self.copy_file(source, target)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [target for _, target in self._csrc_copies()]


def _asked(variable: str) -> bool:
    return os.environ.get(variable, "0") not in ("", "0")


def _torch_extension_tools():
    """torch.utils.cpp_extension; exits with a message when torch is not importable."""
    try:
        import torch  # noqa: F401
        from torch.utils import cpp_extension
    except ImportError as exc:  # asked for a compiled backend and cannot build it: stop, say why
        sys.exit(
            f"specdec_kernels: SPECDEC_BUILD_CPU / SPECDEC_BUILD_CUDA need torch at build time, and it is not "
            f"importable here ({exc}). pip builds in an isolated environment without torch: install torch "
            "first, then add --no-build-isolation, e.g. `SPECDEC_BUILD_CPU=1 pip install --no-build-isolation -e .`"
        )
    return cpp_extension


def _cpu_extensions():
    if not _asked("SPECDEC_BUILD_CPU"):
        return []
    tools = _torch_extension_tools()
    build = BUILD["cpu"]
    return [
        tools.CppExtension(
            name="specdec_kernels.ops.csrc._csrc_cpu",
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
            name="specdec_kernels.ops.csrc._csrc_cuda",
            sources=[os.path.join(CSRC, s) for s in build["sources"]],
            include_dirs=[os.path.abspath(CSRC)],
            extra_compile_args={"cxx": build["cflags"], "nvcc": build["cuda_cflags"]},
            extra_link_args=build.get("ldflags", []),
        )
    ]


ext_modules = _cpu_extensions() + _cuda_extensions()
cmdclass = {"build_py": BuildPyWithCsrc}
if ext_modules:
    from torch.utils.cpp_extension import BuildExtension

    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)
setup(ext_modules=ext_modules, cmdclass=cmdclass)
