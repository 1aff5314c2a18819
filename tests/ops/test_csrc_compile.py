"""csrc/ builds for real GPU targets, without a GPU (CI has none).

* every csrc/*.cu compiles with nvcc to object code for sm_80 and sm_90 (skipped without nvcc);
* the torch binding compiles with -DSPECDEC_WITH_CUDA (the CUDA build's configuration; the CPU
  build of it is compiled and run by test_csrc_core.py) - skipped without a C++ compiler or torch
  headers;
* the host build of the core is warning-free under -Wall -Wextra.

Compiles are cached by a hash of the command, the compiler's version and every csrc source and
header (``build/compile_checks/``): a test compiles again only when something it depends on changed,
so nvcc runs once per change, not once per test session. The .cu compile is slow (tens of seconds
per architecture, many minutes on a busy machine) and runs under ``-m slow``.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
ARCHS = ("80", "90")


def _nvcc():
    sys.path.insert(0, str(ROOT))
    from bench.bench_static import _nvcc as find_nvcc  # one nvcc search for the tests and bench_static

    return find_nvcc()


CACHE = ROOT / "build" / "compile_checks"


def _fingerprint(cmd: list[str]) -> str:
    """Hash of a compile command, the compiler's version and every csrc file it may include."""
    digest = hashlib.sha256("\0".join(cmd).encode())
    version = subprocess.run([cmd[0], "--version"], capture_output=True, text=True).stdout
    digest.update(version.encode())
    for path in sorted(CSRC.glob("*")):
        if path.suffix in (".h", ".cu", ".cpp", ".cuh"):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:24]


def _compiled_before(cmd: list[str]) -> Path | None:
    """The marker of a successful earlier run of this exact compile, if any."""
    marker = CACHE / _fingerprint(cmd)
    return marker if marker.is_file() else None


def _remember(cmd: list[str], note: str) -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / _fingerprint(cmd)).write_text(note)


def _cxx():
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


@pytest.mark.slow
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.cu")))
def test_cu_compiles_for_sm80_and_sm90(source, tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    cmd = [
        nvcc,
        "-c",
        "-std=c++17",
        "-O3",
        f"-I{CSRC}",
        "-DSPECDEC_WITH_CUDA",
        *gencode,
        "-t",
        "2",
        str(CSRC / source),
        "-o",
        "OUT.o",
    ]
    if _compiled_before(cmd):
        return
    result = subprocess.run([*cmd[:-1], str(tmp_path / "out.o")], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    cuobjdump = shutil.which("cuobjdump") or str(Path(nvcc).with_name("cuobjdump"))
    if Path(cuobjdump).is_file():
        listing = subprocess.run([cuobjdump, "--list-elf", str(tmp_path / "out.o")], capture_output=True, text=True)
        for arch in ARCHS:
            assert f"sm_{arch}" in listing.stdout, listing.stdout
    _remember(cmd, result.stderr)


@pytest.mark.slow  # a syntax-only pass over torch's headers: ~60 s, beside the slow nvcc compiles
def test_binding_compiles_with_cuda_flag():
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    try:
        from torch.utils.cpp_extension import include_paths
    except ImportError:
        pytest.skip("torch not importable")
    includes = include_paths()
    if not any((Path(p) / "torch" / "extension.h").is_file() for p in includes):
        pytest.skip("torch C++ headers missing")
    cmd = [
        cxx,
        "-std=c++17",
        "-fsyntax-only",
        "-DSPECDEC_WITH_CUDA",
        "-DTORCH_EXTENSION_NAME=specdec_check",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f"-I{p}" for p in includes),
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{CSRC}",
        str(CSRC / "binding.cpp"),
    ]
    import torch

    key = [*cmd, f"torch=={torch.__version__}"]  # the headers change with torch
    if _compiled_before(key):
        return
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if result.returncode != 0 and "-std=c++17" in result.stderr:  # newer torch headers may need C++20
        cmd[1] = "-std=c++20"
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    _remember(key, result.stderr)


def test_host_core_is_warning_free():
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    flags = json.loads((CSRC / "build.json").read_text())["cpu"]["cflags"]  # -fopenmp: the pragmas count
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", *flags, f"-I{CSRC}"]
    cmd.append(str(CSRC / "verify_cpu.cpp"))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
