"""The csrc CPU core on edge inputs, and the csrc tests re-run under ASan + UBSan.

The fast tests run the CPU build (``backend="cpu"``) on ragged, zero-size and extreme inputs against
the reference. The slow test builds the sanitized variant of the same sources (``cpu_sanitize`` in
csrc/build.json: ``-fsanitize=address,undefined -fno-sanitize-recover=all``) and runs this module's
edge inputs and the csrc test modules against it in a subprocess started with the ASan runtime
preloaded (``SPECDEC_CSRC_SANITIZE=1`` makes ``load_cpu_core`` load it): an out-of-bounds access,
a use after free, a signed overflow, a division by zero, a misaligned or out-of-range shift aborts
that process and fails the test.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels.reference import verify_multi_reference, verify_reference, verify_tree_reference

from ._inputs import make_problem
from ._trees import make_tree_problem
from .conftest import cpu_core_or_skip

ROOT = Path(__file__).resolve().parents[2]
# The csrc test modules the sanitized run repeats (besides this one's edge inputs).
CSRC_TESTS = [
    "tests/ops/test_csrc_core.py",
    "tests/ops/test_csrc_tree_core.py",
    "tests/ops/test_cpu_backend.py",
    "tests/ops/test_cpu_native_mask.py",  # token_bitmask read by the core: strided, zero-size, bits past V
    "tests/hf/test_cpu_f32.py",  # the native fp32 linear: panel remainders, row passes, zero sizes
    "tests/hf/test_cpu_int8_native.py",  # the native int8 linear: likewise
]
MIN_SANITIZED_PASSES = 300  # of the ~490 tests those modules and this one hold (a collection slip must fail)
SANITIZED_RUN_SECONDS = 3600  # build (about two minutes) and the tests, 5-10x slower under ASan


@pytest.fixture(scope="module", autouse=True)
def core():
    return cpu_core_or_skip()


def _same(out, ref):
    for name in ("tokens", "num_accepted", "accepted_nodes", "nonfinite"):
        if hasattr(ref, name):
            assert torch.equal(getattr(out, name), getattr(ref, name)), name


def _extreme(x: torch.Tensor) -> torch.Tensor:
    """Logits with NaN, +-inf, the largest finite floats and a whole -inf row."""
    x = x.clone()
    flat = x.view(-1, x.shape[-1])
    if flat.shape[0] == 0 or flat.shape[1] < 4:
        return x
    flat[0, :4] = torch.tensor([float("nan"), float("inf"), 3.0e38, -3.0e38])
    flat[-1] = float("-inf")
    if flat.shape[0] > 2:
        flat[1, 1] = -float("inf")
        flat[2] *= 1e30
    return x


CHAIN_CASES = {
    "B0": dict(B=0, G=3, V=50),
    "G0": dict(B=3, G=0, V=50),
    "V1": dict(B=3, G=2, V=1),
    "ragged": dict(B=4, G=4, V=300, n=[4, 0, 1, 3]),
    "extreme": dict(B=3, G=3, V=200, extreme=True),
    "extreme_filtered": dict(B=3, G=3, V=200, extreme=True, top_k=[1, 0, 300], top_p=[1.0, 1e-6, 0.5]),
    "temperatures": dict(B=4, G=2, V=64, temperature=[0.0, 1e-30, 1e4, 1.0]),
    "big_seed": dict(B=2, G=3, V=100, seed=2**62 - 1),
}


@pytest.mark.parametrize("draft", ["logits", "probs", "ngram"])
@pytest.mark.parametrize("case", list(CHAIN_CASES))
def test_chain_edge_inputs(case, draft):
    c = dict(CHAIN_CASES[case])
    B, G, V = c.pop("B"), c.pop("G"), c.pop("V")
    target, tokens, logits = make_problem(B, G, V, seed=B + G + V)
    if c.pop("extreme", False):
        target, logits = _extreme(target), _extreme(logits)
    kw: dict = {"seed": c.pop("seed", torch.arange(B) * 3 + 1)}
    for name in ("temperature", "top_k", "top_p"):
        if name in c:
            kw[name] = torch.tensor(c.pop(name))
    if "n" in c:
        kw["num_draft_tokens"] = torch.tensor(c.pop("n"))
    if draft == "logits":
        kw["draft_logits"] = logits
    elif draft == "probs":
        kw["draft_probs"] = torch.softmax(logits.nan_to_num(0.0, 0.0, 0.0), -1)
    _same(sk.verify(target, tokens, backend="cpu", **kw), verify_reference(target, tokens, **kw))


TREE_CASES = {
    "B0": dict(B=0, N=4, V=50),
    "N1": dict(B=3, N=1, V=50),
    "ragged": dict(B=4, N=7, V=300, n=[7, 0, 1, 4]),
    "all_empty": dict(B=2, N=5, V=80, n=[0, 0]),
    "extreme": dict(B=3, N=6, V=200, extreme=True, top_k=[1, 0, 7], top_p=[1.0, 1e-6, 0.9]),
    "V1": dict(B=2, N=3, V=1),
    "N0": dict(B=3, N=0, V=50),
}
_TREE_PARAMS = list(TREE_CASES)  # N0 died of SIGFPE before the zero-size fix (csrc divided node ids by G)


@pytest.mark.parametrize("method", ["kseq", "rrs", "rrs_wor"])
@pytest.mark.parametrize("case", _TREE_PARAMS)
def test_tree_edge_inputs(case, method):
    c = dict(TREE_CASES[case])
    B, N, V = c.pop("B"), c.pop("N"), c.pop("V")
    n = torch.tensor(c.pop("n")) if "n" in c else None
    target, tokens, parents, logits = (
        t[:B]  # B = 0: a batch of one, sliced empty
        for t in make_tree_problem(max(B, 1), N, V, seed=N + V, without_replacement=method == "rrs_wor", num_nodes=n)
    )
    if method == "rrs_wor" and V < N:
        pytest.skip("without replacement needs V >= siblings")
    if c.pop("extreme", False):
        target, logits = _extreme(target), _extreme(logits)
    kw: dict = dict(method=method, draft_logits=logits, num_nodes=n, seed=torch.arange(B) + 5)
    for name in ("top_k", "top_p"):
        if name in c:
            kw[name] = torch.tensor(c.pop(name))
    _same(
        sk.verify_tree(target, tokens, parents, backend="cpu", **kw),
        verify_tree_reference(target, tokens, parents, **kw),
    )


@pytest.mark.parametrize("method", ["kseq", "rrs"])
def test_multi_edge_inputs(method):
    B, K, G, V = 3, 3, 2, 120
    target, tokens, logits = make_problem(B * K, G, V, seed=11)
    target = _extreme(target).reshape(B, K, G + 1, V)
    tokens, logits = tokens.reshape(B, K, G), logits.reshape(B, K, G, V)
    tokens[:, 1] = tokens[:, 0]  # a duplicated chain: merged with multiplicity
    kw = dict(draft_logits=logits, method=method, seed=torch.arange(B), top_k=torch.tensor([0, 1, 5]))
    _same(sk.verify_multi(target, tokens, backend="cpu", **kw), verify_multi_reference(target, tokens, **kw))


def _libasan() -> str | None:
    """The GCC ASan runtime the sanitized build links against (None without gcc)."""
    compiler = shutil.which("gcc")
    if compiler is None:
        return None
    path = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.skipif(os.environ.get("SPECDEC_CSRC_SANITIZE", "0") in ("", "0"), reason="SPECDEC_CSRC_SANITIZE unset")
def test_the_sanitized_build_is_the_one_loaded(core):
    assert core.__name__ == "specdec_csrc_cpu_asan_ubsan"


# Run in the child: drop LD_PRELOAD before anything else so the compiler and ninja it starts for the
# just-in-time build are not sanitized themselves, then run pytest in this process.
_CHILD = "import os, sys, pytest; os.environ.pop('LD_PRELOAD', None); sys.exit(pytest.main(sys.argv[1:]))"


@pytest.mark.slow
def test_csrc_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    """The csrc tests and this module's edge inputs, against the ASan + UBSan build: exit status 0
    and no sanitizer report (any report aborts the child: -fno-sanitize-recover=all)."""
    libasan = _libasan()
    if libasan is None:
        pytest.skip("no GCC ASan runtime (gcc -print-file-name=libasan.so)")
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=libasan,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=86",  # CPython and torch leak on purpose
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
        SPECDEC_CSRC_SANITIZE="1",
        SPECDEC_REQUIRE_CPU_BUILD="1",  # a failed sanitized build is a failure, not a skip
        SPECDEC_TEST_THREADS=env.get("SPECDEC_TEST_THREADS", "1"),
    )
    # --capture=sys: a report written to fd 2 by the dying process must reach the output
    args = [
        *CSRC_TESTS,
        __file__,
        "-k",
        # a C++ exception (TORCH_CHECK) under the preloaded ASan runtime trips its __cxa_throw interceptor
        "not sanitizers and not kernel_checks_its_arguments",
        "-q",
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
        "-x",
        "--capture=sys",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SANITIZED_RUN_SECONDS,
    )
    output = proc.stdout + proc.stderr
    assert "ERROR: AddressSanitizer" not in output and "runtime error:" not in output, output[-6000:]
    assert proc.returncode == 0, output[-6000:]
    passed = re.search(r"(\d+) passed", output)
    assert passed and int(passed.group(1)) >= MIN_SANITIZED_PASSES, output[-3000:]  # the modules did run
