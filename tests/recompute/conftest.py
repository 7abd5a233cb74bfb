"""Fixtures of the recompute tests: data, and graph rewrites off."""

import numpy as np
import pytest


@pytest.fixture
def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    return x, y


@pytest.fixture(autouse=True)
def no_graph_rewrites(no_graph_rewrites):
    """Every recompute test without grappler (tests/conftest.py says why):
    the exactness tests check the mechanism, and
    `test_under_graph_rewrites_equal_up_to_rounding` the default set-up."""
    yield
