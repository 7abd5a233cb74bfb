"""`kgb.gradcheck` and `kgb.assert_gradients_close`: planted wrong gradients
(values, shapes, dtypes, second order, eager vs XLA) are caught and named;
correct functions, Keras layers and models pass."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gradboost as kgb
from keras_gradboost.gradcheck import target as target_module

X = tf.constant([[-3.0, 0.5, 2.0, 0.1], [1.0, -1.0, 0.3, 4.0], [0.2, 0.0, -0.7, 1.5]])


def softplus_with(grad_of):
    """softplus with the hand-written gradient `grad_of(x, upstream)`."""

    @tf.custom_gradient
    def f(x):
        def grad(upstream):
            return grad_of(x, upstream)

        return tf.math.softplus(x), grad

    return f


right = softplus_with(lambda x, up: up * tf.sigmoid(x))


def test_a_correct_custom_gradient_passes_every_check():
    result = kgb.gradcheck(right, X, second_order=True)
    assert result.ok, result
    (source,) = result.sources
    assert source.name == "input 'x'" and source.shape == (3, 4) and source.gradient == "tensor"
    assert source.max_abs_error < 1e-6 and source.max_rel_error < 1e-6
    for error in (source.forward_error, source.jit_error, source.second_order_error):
        assert error is not None and error < 1e-5
    assert result["x"] is source
    text = str(result)
    assert text.startswith("gradcheck: ok; mode=full, numeric differences in float64")
    assert "input 'x'  (3, 4)  float32  tensor" in text


def test_a_planted_wrong_gradient_is_caught_in_full_and_fast_mode():
    wrong = softplus_with(lambda x, up: up * tf.sigmoid(x) * 1.01)  # 1% off
    for mode in ("full", "fast"):
        result = kgb.gradcheck(wrong, X, mode=mode, jit=False, forward=False)
        assert not result.ok and result.mode == mode
        (problem,) = result.problems
        assert problem.startswith("input 'x': the reverse-mode gradient differs from the numeric one")
    with pytest.raises(AssertionError, match="FAILED \\(1 of 1 sources\\)"):
        kgb.assert_gradients_close(wrong, X, jit=False)


@pytest.mark.parametrize(
    "grad_of, received",
    [
        (lambda x, up: tf.reduce_sum(up * tf.sigmoid(x)), "()"),  # a scalar for a matrix
        (lambda x, up: tf.reduce_sum(up * tf.sigmoid(x), axis=0), "(4,)"),  # a summed axis
    ],
    ids=["scalar", "summed_axis"],
)
def test_a_wrong_shape_gradient_fails_naming_the_input_and_both_shapes(grad_of, received):
    wrong = softplus_with(grad_of)
    # TensorFlow itself takes it silently, even as a variable's gradient:
    w = tf.Variable(X)
    with tf.GradientTape() as tape:
        y = wrong(w * 1.0)
    assert str(tuple(tape.gradient(y, w).shape)) == received
    result = kgb.gradcheck(wrong, X, jit=False)
    assert not result.ok and result["x"].gradient == f"shape {received}"
    (problem,) = result.problems
    assert problem.startswith(
        f"input 'x': the gradient has the wrong shape: expected (3, 4) (the "
        f"input's shape), received {received}."
    )


def test_a_wrong_dtype_gradient_fails():
    wrong = softplus_with(lambda x, up: tf.cast(up * tf.sigmoid(x), tf.float64))
    result = kgb.gradcheck(wrong, X, jit=False, forward=False)
    assert result["x"].gradient == "dtype float64"
    assert "expected float32 (the input's dtype), received float64" in result.problems[0]


def test_a_gradient_that_differs_under_xla_is_caught():
    # Right in eager, doubled when traced (a Python branch on eagerness).
    traced_double = softplus_with(
        lambda x, up: up * tf.sigmoid(x) * (1.0 if tf.executing_eagerly() else 2.0)
    )
    result = kgb.gradcheck(traced_double, X, forward=False)
    assert "differs from eager" in " ".join(result.problems)
    assert result["x"].jit_error == pytest.approx(1.0, rel=1e-3)


def test_a_wrong_second_order_gradient_is_caught_only_when_asked():
    # First order right, but its own gradient cut: d2/dx2 comes out 0.
    cut = softplus_with(lambda x, up: up * tf.stop_gradient(tf.sigmoid(x)))
    assert kgb.gradcheck(cut, X, jit=False).ok
    result = kgb.gradcheck(cut, X, jit=False, forward=False, second_order=True)
    (problem,) = result.problems
    assert "the second-order gradient differs from the numeric one" in problem


def test_forward_mode_is_compared_with_reverse_mode(monkeypatch):
    original = target_module.Target.jvp
    monkeypatch.setattr(target_module.Target, "jvp", lambda self, i, v: 2.0 * original(self, i, v))
    result = kgb.gradcheck(right, X, jit=False)
    (problem,) = result.problems
    assert problem.startswith("input 'x': forward mode disagrees with reverse mode")


def test_none_and_zero_gradients_are_reported_as_such():
    def f(x, unused, zeroed, cut):
        return x * 2.0 + 0.0 * zeroed + tf.stop_gradient(cut)

    v = tf.constant([1.0, 2.0])
    result = kgb.gradcheck(f, v, v, v, v, jit=False)
    assert [s.gradient for s in result.sources] == ["tensor", "None", "zero", "None"]
    assert [s.ok for s in result.sources] == [True, True, True, False]
    (problem,) = result.problems
    assert problem.startswith("input 'cut': the gradient is None (TensorFlow sees no path")
    assert "but the outputs depend on it" in problem
    fast = kgb.gradcheck(f, v, v, v, v, jit=False, mode="fast")
    assert [s.ok for s in fast.sources] == [True, True, True, False]


def test_several_inputs_broadcasting_and_integer_arguments():
    def f(a, b, k):
        return tf.tanh(a * b) * tf.cast(k, a.dtype)

    result = kgb.gradcheck(f, X, tf.constant([0.5, -1.0, 2.0, 0.3]), 3, jit=False)
    assert result.ok, result
    assert [s.name for s in result.sources] == ["input 'a'", "input 'b'"]


def test_an_indexed_slices_gradient_is_checked_dense():
    params = tf.constant(np.arange(12.0, dtype="float32").reshape(4, 3) / 10)
    result = kgb.gradcheck(lambda p: tf.gather(p, [0, 2, 2]) ** 2, params, jit=False)
    assert result.ok, result
    assert result.sources[0].gradient == "IndexedSlices"


def test_keras_layers_are_checked_for_inputs_and_every_trainable_weight():
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(3, activation="tanh", name="dense")
    result = kgb.gradcheck(layer, tf.random.normal((2, 4)))
    assert result.ok, result
    assert [s.name for s in result.sources] == [
        "input 'inputs'", "weight 'dense/kernel'", "weight 'dense/bias'"]
    assert all(s.max_abs_error < 1e-5 for s in result.sources)


def test_a_keras_model_is_rebuilt_in_float64_for_the_differences():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.LayerNormalization(name="norm")(
        keras.layers.Dense(5, activation="gelu", name="d1")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="d2")(hidden))
    result = kgb.gradcheck(model, tf.random.normal((3, 4)), jit=False)
    assert result.ok, result
    assert result.numeric_dtype == "float64"
    assert len(result.sources) == 1 + len(model.trainable_variables)
    # The float64 differences are far more precise than float32 ones.
    assert max(s.max_abs_error for s in result.sources) < 1e-5


class WrongKernelGrad(keras.layers.Layer):
    """x @ kernel, whose hand-written kernel gradient is transposed wrong."""

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], shape[-1]), name="kernel")

    def call(self, x):
        kernel = self.kernel.value

        @tf.custom_gradient
        def matmul(x):
            def grad(upstream, variables=None):
                dx = upstream @ tf.transpose(kernel)
                dk = tf.transpose(x) @ upstream
                return dx, [tf.transpose(dk)]  # planted: transposed

            return x @ kernel, grad

        return matmul(x)


def test_a_wrong_weight_gradient_names_the_weight():
    keras.utils.set_random_seed(0)
    layer = WrongKernelGrad(name="wrong")
    result = kgb.gradcheck(layer, tf.random.normal((2, 3)), jit=False, forward=False,
                           numeric_dtype=None)
    assert result.sources[0].ok and not result.sources[1].ok
    assert result.problems[0].startswith("weight 'wrong/kernel': the reverse-mode gradient")


def test_half_precision_inputs_are_compared_with_float64_differences():
    x = tf.constant([-2.0, 0.5, 3.0], tf.float16)
    result = kgb.gradcheck(right, x, jit=False)
    assert result.ok, result
    assert result.sources[0].dtype == "float16"


def test_fast_mode_on_a_large_input_passes_and_catches_a_wrong_gradient():
    x = tf.random.stateless_normal((100, 100), seed=[1, 2])
    assert kgb.gradcheck(right, x, mode="auto", jit=False).mode == "fast"
    assert kgb.gradcheck(right, x, mode="fast", jit=False).ok
    wrong = softplus_with(lambda x, up: up * tf.sigmoid(x) * 1.01)
    assert not kgb.gradcheck(wrong, x, mode="fast", jit=False, forward=False).ok


def test_a_function_that_cannot_run_in_float64_is_refused_with_the_fix():
    def f(x):
        return x * tf.constant(2.0)  # float32 only

    with pytest.raises(TypeError, match="failed when re-run in float64.*numeric_dtype=None"):
        kgb.gradcheck(f, X)
    result = kgb.gradcheck(f, X, numeric_dtype=None, jit=False)
    assert result.ok and "own dtypes" in result.numeric_dtype
    # A function that computes in float32 inside, whatever its inputs.
    with pytest.raises(TypeError, match="returned \\['float32'\\] outputs"):
        kgb.gradcheck(lambda x: tf.image.resize(x, (3, 3)), tf.ones((1, 2, 2, 1)))


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"atol": -1.0}, ValueError, "Received: atol=-1.0. Expected a float >= 0 or None"),
        ({"rtol": "1"}, TypeError, "Invalid type for argument `rtol`"),
        ({"mode": "exact"}, ValueError, "Received: mode='exact'. Expected one of 'auto', 'full', 'fast'"),
        ({"probes": 0}, ValueError, "Received: probes=0"),
        ({"jit": 1}, TypeError, "Invalid type for argument `jit`"),
        ({"numeric_dtype": "float32"}, ValueError, "Expected \"float64\" or None"),
        ({"step": 0.0}, ValueError, "Received: step=0.0"),
    ],
)
def test_invalid_arguments_are_refused_naming_them(kwargs, error, text):
    with pytest.raises(error, match=text.replace("(", "\\(").replace(")", "\\)")):
        kgb.gradcheck(right, X, **kwargs)


def test_nothing_to_differentiate_and_too_large_jacobians_are_refused():
    with pytest.raises(ValueError, match="nothing to differentiate"):
        kgb.gradcheck(lambda k: tf.cast(k, tf.float32), tf.constant([1, 2]))
    with pytest.raises(ValueError, match="mode='fast'"):
        kgb.gradcheck(tf.tanh, tf.zeros((8000,)), mode="full")
