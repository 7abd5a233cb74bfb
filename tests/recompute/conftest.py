"""Fixtures of the recompute tests: data, and graph rewrites off."""

import numpy as np
import pytest

from recompute.models import grappler


@pytest.fixture
def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    return x, y


@pytest.fixture(autouse=True)
def no_graph_rewrites():
    """Grappler rewrites a graph by what its backward keeps: it fuses
    MatMul+BiasAdd+Gelu, or folds Dropout's scale into neighbours, only where
    the intermediates are not needed, and under load a pass may time out and
    leave one of two graphs unfused. The plain and the recomputed graphs
    then round differently (same maths; in bfloat16 visibly, in float32 at
    1e-7, which a few steps at learning rate 0.1 can grow past 1e-6).
    Without grappler both run the same ops and must agree exactly: the
    exactness tests check the mechanism, and
    `test_under_graph_rewrites_equal_up_to_rounding` the default set-up."""
    before = grappler(True)
    yield
    grappler(before)
