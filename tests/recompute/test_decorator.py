"""`kgb.Recompute(layer)` and `kgb.recompute_function(fn)`: gradients equal to the
undecorated block's (Dropout masks and BatchNormalization statistics
included), on the mechanism of `compile(recompute=...)`."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_gradboost as kgb
from keras_gradboost.recompute import mechanism


def _block(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dropout(0.4, seed=3),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(4),
        ],
        name="block",
    )


def _state(layer):
    return [v.numpy() for v in layer.non_trainable_variables]


def _restore(layer, values):
    for v, value in zip(layer.non_trainable_variables, values):
        v.assign(value)


def _step(call, variables, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(call(x) ** 2)
    return tape.gradient(loss, [x] + variables)


X = tf.constant(np.random.default_rng(0).normal(size=(5, 6)), tf.float32)


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_recompute_layer_gradients_equal_the_plain_blocks(traced, policy):
    block = _block()
    before = _state(block)  # seeds and moving statistics
    plain = _step(lambda x: block(x, training=True), block.trainable_variables, X)
    after_plain = _state(block)
    _restore(block, before)
    wrapped = kgb.Recompute(block, policy=policy)

    def step(x):  # the variables are captured, not tf.function arguments
        return _step(lambda x: wrapped(x, training=True), block.trainable_variables, x)

    recomputed = (tf.function(step) if traced else step)(X)
    for a, b in zip(plain, recomputed):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # Seeds and moving statistics were updated once, as by the plain block.
    for a, b in zip(after_plain, _state(block)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert mechanism.is_marked(block)
    # Selective: the kernel layers are marked, so their outputs can be kept.
    assert mechanism.is_marked(block.layers[0]) == (policy == "selective")


def test_the_backward_pass_runs_the_block_again():
    block = _block()
    calls = []
    inner = block.layers[0]
    original = inner.call
    inner.call = lambda *a, **k: calls.append(1) or original(*a, **k)
    _step(lambda x: block(x, training=True), block.trainable_variables, X)
    assert len(calls) == 1
    calls.clear()
    wrapped = kgb.Recompute(block)
    _step(lambda x: wrapped(x, training=True), block.trainable_variables, X)
    assert len(calls) == 2  # forward, and the recompute in the backward


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_decorator_on_a_function_equals_the_undecorated_function(policy):
    keras.utils.set_random_seed(0)
    dense, drop = keras.layers.Dense(8, activation="tanh"), keras.layers.Dropout(0.5, seed=1)
    dense.build((None, 6))

    def block(x):
        return drop(dense(x), training=True) * 2.0

    seeds = _state(drop)
    plain = _step(block, dense.trainable_variables, X)
    _restore(drop, seeds)
    decorated_block = kgb.recompute_function(block, layers=[dense, drop], policy=policy)
    decorated = tf.function(lambda x: _step(decorated_block, dense.trainable_variables, x))(X)
    for a, b in zip(plain, decorated):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # The decorator form, and a layer given to recompute.
    assert callable(kgb.recompute_function(layers=[dense])(block))
    assert isinstance(kgb.recompute_function(dense), kgb.Recompute)


def test_recompute_in_a_functional_model_trains_like_the_plain_one():
    def build(wrap):
        block = _block(seed=1)
        inputs = keras.Input((6,))
        hidden = (kgb.Recompute(block, policy="selective") if wrap else block)(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer="sgd", loss="mse")
        return model

    y = tf.ones((5, 1))
    plain, wrapped = build(False), build(True)
    wrapped.set_weights(plain.get_weights())
    for model in (plain, wrapped):
        model.fit(X, y, epochs=2, verbose=0, shuffle=False)
    for a, b in zip(plain.get_weights(), wrapped.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    config = keras.saving.serialize_keras_object(wrapped.layers[1])
    restored = keras.saving.deserialize_keras_object(config)
    assert isinstance(restored, kgb.Recompute) and restored.layer.name == "block"
    assert restored.policy == "selective"


def test_wrong_arguments_are_refused_naming_them():
    with pytest.raises(TypeError, match="argument `layer`. Received: layer=3"):
        kgb.Recompute(3)
    with pytest.raises(TypeError, match="argument `fn`"):
        kgb.recompute_function("block")
    with pytest.raises(TypeError, match="argument `layers`"):
        kgb.recompute_function(lambda x: x, layers=["dense"])
    with pytest.raises(ValueError, match="argument `policy`. Received: policy='some'"):
        kgb.Recompute(keras.layers.Dense(2), policy="some")
    with pytest.raises(ValueError, match="argument `policy`"):
        kgb.recompute_function(lambda x: x, policy=None)


def test_the_decorator_does_not_shadow_the_recompute_package():
    """`kgb.recompute` stays the package (`import keras_gradboost.recompute
    as rc` binds it): the function is `kgb.recompute_function`."""
    import inspect

    import keras_gradboost.recompute as package

    assert inspect.ismodule(kgb.recompute) and inspect.ismodule(package)
    assert kgb.recompute_function is package.recompute_function


@pytest.mark.parametrize("left_out", ["dropout", "batchnorm"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_a_stateful_layer_left_out_of_layers_is_refused_before_any_update(
    left_out, traced
):
    """Without the Dropout layer in `layers`, the recompute drew a new mask:
    its gradients differed from the plain block's, silently. Now building
    the gradient names the variable, before the weights change."""
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(8, activation="tanh")
    dense.build((None, 6))
    other = (
        keras.layers.Dropout(0.5, seed=1)
        if left_out == "dropout"
        else keras.layers.BatchNormalization()
    )
    other.build((None, 8))
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(dense.trainable_variables)
    block = kgb.recompute_function(
        lambda x: other(dense(x), training=True), layers=[dense]
    )

    def step(x):
        grads = _step(block, dense.trainable_variables, x)[1:]
        optimizer.apply(grads, dense.trainable_variables)

    before = [v.numpy() for v in dense.trainable_variables]
    owned = (
        other.seed_generator.state if left_out == "dropout" else other.moving_mean
    )
    with pytest.raises(ValueError, match=f"block '<lambda>' exactly.*'{owned.path}'"):
        (tf.function(step) if traced else step)(X)
    for a, v in zip(before, dense.trainable_variables):
        np.testing.assert_array_equal(a, v.numpy())
    # Listed, the same block is exact against the plain one.
    keras.utils.set_random_seed(0)
    listed = kgb.recompute_function(
        lambda x: other(dense(x), training=True), layers=[dense, other]
    )
    state = _state(other)
    plain = _step(lambda x: other(dense(x), training=True), dense.trainable_variables, X)
    _restore(other, state)
    for a, b in zip(plain, _step(listed, dense.trainable_variables, X)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_layer_drawing_from_the_global_seed_generator_is_refused():
    """A custom layer calling `keras.random.dropout` without a seed of its
    own updates Keras' global seed generator, which no layer owns: the
    recompute would draw another mask, so `Recompute` refuses it."""

    class NoisyDense(keras.layers.Dense):
        def call(self, x, training=None):
            return keras.random.dropout(super().call(x), 0.5)

    keras.utils.set_random_seed(0)
    wrapped = kgb.Recompute(NoisyDense(4))
    wrapped.build((None, 6))
    with pytest.raises(ValueError, match="seed_generator_state"):
        _step(lambda x: wrapped(x, training=True), wrapped.trainable_variables, X)
