"""What every worker process loads: the built-in `digits` (scikit-learn's data, read without importing
scikit-learn) and no engine module importing pandas or scikit-learn as it loads (seconds of start-up in
every worker, command line and kernel)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import numpy as np

from workbench.data import _digits_arrays, digits


def test_digits_are_scikit_learns_own_read_without_importing_it(monkeypatch):
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "sklearn.datasets", None)  # importing it now raises ImportError
        inputs, targets = _digits_arrays()
    from sklearn.datasets import load_digits

    expected_inputs, expected_targets = load_digits(return_X_y=True)
    assert inputs.dtype == expected_inputs.dtype and targets.dtype == expected_targets.dtype
    assert np.array_equal(inputs, expected_inputs) and np.array_equal(targets, expected_targets)
    assert inputs.shape == (1797, 64) and sorted(set(targets.tolist())) == list(range(10))


def test_digits_splits_together_hold_all_1797_images_scaled_to_0_1():
    splits = digits()
    train, held_out = splits.train.load(), splits.eval.load()
    assert len(train) + len(held_out) == 1797
    assert float(train.inputs.max()) == 1.0 and float(train.inputs.min()) == 0.0  # pixels scaled to 0-1


ENGINE = Path(__file__).resolve().parents[2] / "workbench"
LOADED_WHERE_USED = ("pandas", "sklearn")  # imported inside the functions that need them


def test_no_engine_module_imports_pandas_or_scikit_learn_when_it_loads():
    found = []
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:  # module level only (not functions, not TYPE_CHECKING)
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(ENGINE.parent)}:{node.lineno} {name}" for name in names
                      if name.split(".")[0] in LOADED_WHERE_USED]
    assert found == [], found
