"""The built-in `digits` as the workers load it: scikit-learn's data, read without importing scikit-learn."""
from __future__ import annotations

import sys

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


def test_digits_splits_hold_every_image_once():
    splits = digits()
    train, held_out = splits.train.load(), splits.eval.load()
    assert len(train) + len(held_out) == 1797
    assert float(train.inputs.max()) == 1.0 and float(train.inputs.min()) == 0.0  # pixels scaled to 0-1
