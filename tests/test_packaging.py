"""Packaging: a wheel install (not editable) can build the native CPU backend just in time, into a
per-user cache (never site-packages or the source tree); where that cache goes and what happens when
it cannot be written."""

import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

from specdec_kernels.ops import csrc

ROOT = Path(__file__).resolve().parents[1]

USE_THE_INSTALLED_WHEEL = """
import sys, torch
import specdec_kernels as sk
from specdec_kernels.reference import verify_reference
assert sk.__file__.startswith(sys.argv[1]), sk.__file__  # the wheel's copy, not the checkout
g = torch.Generator().manual_seed(0)
target, draft = torch.randn(3, 4, 50, generator=g), torch.randn(3, 3, 50, generator=g)
tokens = torch.randint(0, 50, (3, 3), generator=g)
kw = dict(temperature=0.9, seed=torch.tensor([5, 6, 7]))
out = sk.verify(target, tokens, draft, backend="cpu", **kw)
assert torch.equal(out.tokens, verify_reference(target, tokens, draft, **kw).tokens)
print("OK")
"""


@pytest.mark.slow
def test_a_wheel_install_builds_the_cpu_backend_into_the_user_cache(tmp_path):
    wheels, site, cache, elsewhere = (tmp_path / name for name in ("wheels", "site", "cache", "elsewhere"))
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("specdec_kernels-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300)
    assert (site / "specdec_kernels" / "csrc" / "build.json").is_file()

    env = {k: v for k, v in os.environ.items() if k not in ("SPECDEC_BUILD_DIR", "SPECDEC_NO_JIT", "PYTHONPATH")}
    env.update(PYTHONPATH=str(site), TORCH_EXTENSIONS_DIR=str(cache))
    done = subprocess.run(
        [sys.executable, "-c", USE_THE_INSTALLED_WHEEL, str(site)],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
    assert "building the native CPU backend (once" in done.stderr, done.stderr
    assert list(cache.glob("specdec_csrc_cpu_omp-*/specdec_csrc_cpu_omp.so")), sorted(cache.rglob("*"))
    assert not list(site.rglob("*.so")) and not list(site.rglob("build.ninja"))  # nothing built in site-packages


def test_the_cache_location_honours_the_variables_in_order(monkeypatch, tmp_path):
    for variable in ("SPECDEC_BUILD_DIR", "TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert csrc.cache_root() == tmp_path / "home" / ".cache" / "specdec_kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert csrc.cache_root() == tmp_path / "xdg" / "specdec_kernels"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_ext"))
    assert csrc.cache_root() == tmp_path / "torch_ext"
    monkeypatch.setenv("SPECDEC_BUILD_DIR", str(tmp_path / "explicit"))
    assert csrc.cache_root() == tmp_path / "explicit"
    path = csrc.build_dir("specdec_csrc_cpu_omp", "cpu")
    assert path.parent == tmp_path / "explicit" and path.name.startswith("specdec_csrc_cpu_omp-") and path.is_dir()
    assert csrc.build_dir("specdec_csrc_cpu_omp", "cpu") == path  # same sources, same directory


def test_a_cache_that_cannot_be_written_falls_back_with_one_warning(monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # a directory below a regular file cannot be created, even by root
    monkeypatch.setenv("SPECDEC_BUILD_DIR", str(blocker / "cache"))
    monkeypatch.setattr(csrc, "_WARNED_READ_ONLY", False)
    monkeypatch.setattr(csrc.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = csrc.build_dir("specdec_csrc_cpu_omp", "cpu")
        again = csrc.build_dir("specdec_csrc_cpu_omp", "cpu")
    assert first == again and (tmp_path / "tmp") in first.parents and first.is_dir()
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and "cannot write the build cache" in said[0], said


def test_a_just_in_time_build_says_so_once_on_stderr(monkeypatch, tmp_path, capsys):
    """The first CPU call spends about a minute compiling: one line on stderr says so (and where);
    a cached build says nothing."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("SPECDEC_BUILD_DIR", str(tmp_path))

    def fake_load(name, build_directory, **kwargs):
        (Path(build_directory) / f"{name}.so").write_text("")
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert csrc._load("cpu", verbose=False) == "module"
    err = capsys.readouterr().err
    assert err.startswith("specdec_kernels: building the native CPU backend (once, ~1 min) into ")
    assert str(tmp_path) in err and len(err.splitlines()) == 1
    assert csrc._load("cpu", verbose=False) == "module"
    assert capsys.readouterr().err == ""


def test_the_prebuilt_modules_are_found_beside_their_loader(monkeypatch):
    """setup.py builds the prebuilt modules into the loader's own package (specdec_kernels.ops.csrc),
    and the loader imports them from there: nothing climbs to the package's __init__."""
    setup = (ROOT / "setup.py").read_text()
    for kind in ("cpu", "cuda"):
        name = f"{csrc.__name__}._csrc_{kind}"
        assert f'name="{name}"' in setup, name
        prebuilt = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, prebuilt)
        assert csrc._prebuilt(kind) is prebuilt
