"""`scripts/mutants.py` stays runnable to the end: every mutant's snippet occurs exactly once in
its file (a refactor that removes or copies one turns this red, instead of the mutant run stopping
at it), and every test a mutant names exists."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _mutants():
    spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module.MUTANTS


MUTANTS = _mutants()


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_snippet_occurs_once(mutant) -> None:
    text = (ROOT / mutant.path).read_text()
    assert text.count(mutant.old) == 1, (
        f"mutant {mutant.name}: {mutant.path} holds {text.count(mutant.old)} copies of "
        f"{mutant.old!r}; plant it where the code now is"
    )
    assert mutant.new != mutant.old


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_named_tests_exist(mutant) -> None:
    for node in mutant.tests:
        path, _, name = node.partition("::")
        assert (ROOT / path).is_file(), f"mutant {mutant.name}: no test file {path}"
        if name:
            name = name.split("[")[0]
            tree = ast.parse((ROOT / path).read_text())
            defined = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
            assert name in defined, f"mutant {mutant.name}: {path} defines no {name}"


def test_names_are_unique() -> None:
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
