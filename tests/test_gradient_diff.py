"""gradient_diff.differing: the comparison behind accumulate_check and
recompute_check."""

import types

import numpy as np

from keras_gradboost import gradient_diff


def variables(*paths):
    return [types.SimpleNamespace(path=p) for p in paths]


def test_round_off_on_a_gradient_that_is_zero_in_exact_arithmetic_does_not_differ():
    # Measured on a keras-hub BERT: an attention key's bias (which the softmax
    # does not see) had gradients of ~7e-13 differing by 1.0e-12, beside a
    # largest gradient of 1.14. Compared with its own magnitude it "differed".
    want = [np.array([1.14, -0.3]), np.array([6.8e-13, -2e-13])]
    got = [np.array([1.14, -0.3]), np.array([-3.4e-13, 5e-13])]
    assert gradient_diff.differing(variables("emb", "key/bias"), want, got, 1e-4) == []


def test_round_off_within_float32_epsilon_of_the_largest_gradient_does_not_differ():
    # Measured on a keras-hub ViT (width 16) with one Dense recomputed: an
    # attention key's bias (zero in exact arithmetic) 5.1e-9 apart, beside
    # gradients of ~0.3; float32's epsilon times 0.3 is 3.6e-8. In float64
    # the same difference is far above round-off, and differs.
    want = [np.array([0.3, -0.1], "float32"), np.array([2e-9, 1e-9], "float32")]
    got = [np.array([0.3, -0.1], "float32"), np.array([-3.1e-9, 1e-9], "float32")]
    assert gradient_diff.differing(variables("mlp", "key/bias"), want, got, 1e-5) == []
    want64 = [a.astype("float64") for a in want]
    got64 = [a.astype("float64") for a in got]
    found = gradient_diff.differing(variables("mlp", "key/bias"), want64, got64, 1e-5)
    assert [path for path, _ in found] == ["key/bias"]
    # A gradient above round-off keeps its relative tolerance: 12% off a
    # gradient of 1e-6 (well above epsilon x 0.3) is found in float32 too.
    want = [np.array([0.3], "float32"), np.array([1e-6], "float32")]
    got = [np.array([0.3], "float32"), np.array([1.12e-6], "float32")]
    found = gradient_diff.differing(variables("mlp", "small"), want, got, 1e-5)
    assert [path for path, _ in found] == ["small"]


def test_a_real_difference_on_a_small_gradient_still_differs():
    # 1e-6 off a gradient of 1e-5 (10%) is far above round-off of the
    # largest gradient (1.0) and is found, with the None-on-one-side case.
    want = [np.array([1.0]), np.array([1e-5]), np.array([2.0]), None]
    got = [np.array([1.0]), np.array([1.1e-5]), None, None]
    found = gradient_diff.differing(variables("a", "b", "c", "d"), want, got, 1e-4)
    assert [path for path, _ in found] == ["c", "b"]
    assert found[0][1] == float("inf")
    assert np.isclose(found[1][1], 1e-6)


def test_relative_tolerance_per_variable():
    want = [np.array([100.0]), np.array([1.0])]
    got = [np.array([100.005]), np.array([1.005])]  # both 5e-3 / 5e-5 relative
    found = gradient_diff.differing(variables("big", "small"), want, got, 1e-4)
    assert [path for path, _ in found] == ["small"]
