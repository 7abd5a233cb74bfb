"""Input pipelines with few shapes: fewer retraces, fewer XLA recompiles."""

import tensorflow as tf


def bucket_by_length(
    dataset,
    boundaries,
    batch_size,
    length_fn=None,
    padding_value=0,
    drop_remainder=True,
):
    """Batches a variable-length `tf.data` pipeline into a few fixed shapes.

    Every element goes to the smallest bucket whose length covers it and is
    padded to exactly that length, so the batches take at most
    `len(boundaries)` shapes: a `tf.function` or an XLA-compiled train step
    sees a handful of signatures instead of one per length.
    (`RetraceCounter` suggests `boundaries` from the lengths it saw.)

    Args:
        dataset: a `tf.data.Dataset` of unbatched elements: a tensor, or a
            tuple/dict of tensors (e.g. `(tokens, label)`), whose dimensions
            of unknown size are padded.
        boundaries: increasing positive ints, the padded lengths. An element
            longer than the last boundary is an error.
        batch_size: int > 0, examples per batch (in every bucket).
        length_fn: callable taking an element (its components as separate
            arguments for a tuple) and returning its length as a scalar
            tensor. Defaults to `None`: the size of the first dimension of
            the first component whose first dimension has unknown size (the
            components in `tf.nest.flatten` order: a dict's by sorted key),
            so `{"label": ..., "tokens": ...}` is measured by its tokens.
        padding_value: the value padded with. Defaults to `0`.
        drop_remainder: drop each bucket's last batch when it is short, so the
            batch dimension takes a single value too. Defaults to `True`.

    Returns:
        A batched `tf.data.Dataset`.

    Raises:
        ValueError: if `boundaries` is not an increasing sequence of positive
            ints, or `batch_size` is not a positive int, or, without
            `length_fn`, no component has a first dimension of unknown size.
        TypeError: if `dataset` is not a `tf.data.Dataset`.

    Example:

    ```python
    import keras
    import numpy as np
    import tensorflow as tf
    import keras_gradboost

    def gen():  # token sequences of 4 to 63 tokens, and a label
        rng = np.random.default_rng(0)
        for _ in range(256):
            length = int(rng.integers(4, 64))
            yield rng.integers(1, 100, length).astype("int32"), np.int32(length % 2)

    ds = tf.data.Dataset.from_generator(
        gen, output_signature=(tf.TensorSpec((None,), tf.int32),
                               tf.TensorSpec((), tf.int32)))
    ds = keras_gradboost.data.bucket_by_length(ds, [16, 32, 64], batch_size=32)
    inputs = keras.Input((None,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(100, 8)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(h))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    model.fit(ds.repeat(), steps_per_epoch=10)   # at most 3 shapes
    ```
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            "Invalid value for argument `dataset`. Received: "
            f"dataset={dataset!r} of type {type(dataset).__name__}. Expected "
            "a tf.data.Dataset of unbatched elements."
        )
    bounds = _check_boundaries(boundaries)
    _check_batch_size(batch_size)
    tuple_elements = isinstance(dataset.element_spec, tuple)
    length_fn = length_fn or _first_varying_length(dataset.element_spec)

    def length(*element):
        n = length_fn(*element) if tuple_elements else length_fn(element[0])
        n = tf.cast(n, tf.int32)
        check = tf.debugging.assert_less_equal(
            n,
            bounds[-1],
            message=(
                f"bucket_by_length: an element is longer than the last "
                f"boundary ({bounds[-1]}); add a larger boundary or truncate "
                "the elements first"
            ),
        )
        with tf.control_dependencies([check]):
            return tf.identity(n)

    # TensorFlow's bucket i holds lengths < boundary i and pads to
    # boundary i - 1: shift by one so bucket i pads to exactly bounds[i].
    # The extra last bucket (lengths > bounds[-1]) is never reached.
    return dataset.bucket_by_sequence_length(
        length,
        [b + 1 for b in bounds],
        [batch_size] * (len(bounds) + 1),
        padding_values=None if padding_value == 0 else _padding(dataset, padding_value),
        pad_to_bucket_boundary=True,
        drop_remainder=drop_remainder,
    )


def _padding(dataset, value):
    return tf.nest.map_structure(
        lambda spec: tf.constant(value, spec.dtype), dataset.element_spec
    )


def _check_boundaries(boundaries):
    bounds = list(boundaries) if isinstance(boundaries, (list, tuple)) else None
    if (
        not bounds
        or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bounds)
        or any(a >= b for a, b in zip(bounds, bounds[1:]))
    ):
        raise ValueError(
            "Invalid value for argument `boundaries`. Received: "
            f"boundaries={boundaries!r}. Expected a non-empty list of "
            "increasing positive ints (the padded lengths), e.g. [16, 32, 64]."
        )
    return bounds


def _check_batch_size(batch_size):
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            "Invalid value for argument `batch_size`. Received: "
            f"batch_size={batch_size!r}. Expected a positive int."
        )


def _first_varying_length(element_spec):
    """The default `length_fn`: the first dim of the first component (in
    `tf.nest.flatten` order) whose first dim has unknown size."""
    specs = tf.nest.flatten(element_spec)
    varying = [i for i, spec in enumerate(specs) if spec.shape.rank and spec.shape[0] is None]
    if not varying:
        raise ValueError(
            "bucket_by_length: no component of the dataset's elements has "
            "a first dimension of unknown size to measure (element_spec="
            f"{element_spec!r}). Pass `length_fn`, e.g. "
            "`length_fn=lambda x, y: tf.shape(x)[0]`."
        )
    index = varying[0]

    def length_fn(*element):
        return tf.shape(tf.nest.flatten(element)[index])[0]

    return length_fn
