"""scripts/mutation_check.py stays usable: every mutant is found, once, in the function it names
(a refactor that moves or renames the code must move the mutant with it)."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mutation_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("mutation_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_mutant_is_located_once():
    script = _script()
    assert len(script.MUTANTS) >= 20
    for mutant in script.MUTANTS:
        script.locate(mutant)  # ValueError names the mutant that no longer applies


def test_a_pattern_that_moved_is_reported():
    script = _script()
    moved = script.Mutant("gone", "reference", "_verify_request", "no such line", "x")
    with pytest.raises(ValueError, match="gone"):
        script.locate(moved)
