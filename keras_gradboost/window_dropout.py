"""Exact Dropout under gradient accumulation: each micro-batch draws its rows
of the mask the large batch would draw.

Keras' Dropout draws its mask as `tf.random.stateless_uniform(noise_shape,
seed)`, the seed coming from the layer's `SeedGenerator`, which moves on at
each draw. A window of micro-batches equals one large-batch step only if each
micro-batch draws with the seed that step would use, and draws the rows of
that step's mask where its samples sit in the window:

- the generators of the layers drawn this way start every micro-batch of a
  window from the state the window started from (`WindowDraws.drawing`), so
  after a window each has moved as after one large step (a partial window
  flushed at an epoch's end too);
- TensorFlow's Philox gives four 32-bit numbers per counter step, and a
  float32, float16 or bfloat16 draw takes element k from counter step
  k // 4, so a micro-batch's rows are a draw started `first // 4` counter
  steps on, less its first `first % 4` values (`uniform_rows`).

Whether that gives the large batch's values on this TensorFlow, device and
compilation (XLA or not) is checked once per dtype (`draws_rows_exactly`)
before a step relies on it. The rows are those of the tensor's first axis,
which must be the micro-batch's samples: told by its size (at trace time,
or, for a batch of no fixed size, at run time, counted) and, for a layer a
functional graph calls, by the graph. Where any of this does not hold, the
micro-batch draws a mask of its own (the window's seed folded with where it
starts, `own_dropout`), with a warning. Only layers whose draws all go
through Keras' `backend.random.dropout` are drawn this way
(`EXACT_LAYERS`): other random layers (GaussianNoise, the augmentation
layers) still draw per micro-batch, and compile names them.
"""

import contextlib
import functools
import numbers
import threading
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_gradboost import hooks
from keras_gradboost.accumulate import held_generators
from keras_gradboost.state import replica_local_variable

# Keras layers whose only random draws are `backend.random.dropout` on
# tensors whose first axis runs over the samples (an RNN cell's masks are
# (samples, features)); a subclass that overrides `call` is not one.
EXACT_LAYERS = (
    keras.layers.Dropout,
    keras.layers.SpatialDropout1D,
    keras.layers.SpatialDropout2D,
    keras.layers.SpatialDropout3D,
    keras.layers.Attention,
    keras.layers.AdditiveAttention,
    keras.layers.LSTMCell,
    keras.layers.GRUCell,
    keras.layers.SimpleRNNCell,
)

# Dtypes whose uniform draws take one 32-bit number per element.
_ONE_NUMBER_PER_ELEMENT = ("float32", "float16", "bfloat16")

_LOCAL = threading.local()  # the window a step traced in this thread draws in


def draws_exactly(layer):
    """Whether `layer`'s random draws can be drawn as the large batch's:
    one of `EXACT_LAYERS`, with its class's own `call`."""
    return any(type(layer).call is cls.call for cls in EXACT_LAYERS if isinstance(layer, cls))


def uniform_rows(shape, seed, first, dtype):
    """Elements `first, first + 1, ...` of the flat draw
    `tf.random.stateless_uniform([first + size], seed, dtype=dtype)`,
    reshaped to `shape` (whose size is `size`), without drawing the first
    `first` (see the module's docstring; `draws_rows_exactly` checks it)."""
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    alg = tf.raw_ops.StatelessRandomGetAlg()
    first = tf.cast(first, tf.int64)
    skip = tf.cast(first // 4, tf.uint64)
    low = counter[0] + skip
    carry = tf.cast(low < counter[0], tf.uint64)  # the counter is 128 bits
    counter = tf.stack([low, counter[1] + carry])
    extra = first % 4
    size = tf.reduce_prod(tf.cast(shape, tf.int64))
    flat = tf.raw_ops.StatelessRandomUniformV2(
        shape=tf.reshape(size + extra, [1]), key=key, counter=counter, alg=alg, dtype=dtype
    )
    return tf.reshape(flat[extra:], shape)


def dropout_rows(inputs, rate, noise_shape, seed, first_sample, shared=False):
    """Keras' TensorFlow `dropout(inputs, rate, noise_shape, seed)` for the
    samples `first_sample, ...` of a larger batch, along the first axis of
    `inputs`: its mask is those samples' rows of the larger batch's mask.
    `seed` is the int32 seed Keras draws with; `shared`: one mask for every
    sample (the rows of the first)."""
    x = tf.convert_to_tensor(inputs)
    shape = _shape_tensor(hooks.keras_noise_shape(x, noise_shape))
    per_sample = tf.constant(0, tf.int64) if shared else tf.reduce_prod(shape[1:])
    first = tf.cast(first_sample, tf.int64) * per_sample
    random = uniform_rows(shape, seed, first, x.dtype)
    # As TensorFlow's `nn_ops._dropout` computes it, for a Python rate.
    scaled = x * tf.convert_to_tensor(1 / (1 - rate), dtype=x.dtype)
    out = tf.where(random >= rate, scaled, tf.constant(0, x.dtype))
    out.set_shape(x.shape)
    return out


def own_dropout(inputs, rate, noise_shape, seed, first_sample):
    """Keras' TensorFlow `dropout` with `seed` (int32) folded with
    `first_sample`: a micro-batch's mask of its own, another in each
    micro-batch of a window (where its rows of the window's cannot be
    drawn)."""
    x = tf.convert_to_tensor(inputs)
    folded = tf.random.experimental.stateless_fold_in(seed, tf.cast(first_sample, tf.int64))
    return tf.nn.experimental.stateless_dropout(
        x, rate=rate, noise_shape=hooks.keras_noise_shape(x, noise_shape), seed=folded
    )


def _shape_tensor(shape):
    """A noise shape (a shape tensor, or a list of ints and scalar tensors)
    as an int64 tensor."""
    if isinstance(shape, (list, tuple)):
        return tf.stack([tf.cast(d, tf.int64) for d in shape])
    return tf.cast(shape, tf.int64)


# (first sample, samples) of a (6, 5, 3) batch: offsets of 0, 30, 75 and 15
# elements, three of them not whole counter steps.
_CHECKED_PARTS = ((0, 2), (2, 3), (5, 1), (1, 4))


@functools.lru_cache(maxsize=None)
def draws_rows_exactly(dtype, xla):
    """Whether `dropout_rows` gives, bit for bit, the rows of Keras' own
    Dropout draw (`tf.nn.experimental.stateless_dropout`) of a larger
    batch, for `dtype` (a name), compiled by XLA or not. Run once per
    process, eagerly."""
    if dtype not in _ONE_NUMBER_PER_ELEMENT:
        return False
    with tf.init_scope():
        x = tf.cast(tf.reshape(tf.range(1, 91, dtype=tf.float32), (6, 5, 3)), dtype)
        seed = tf.constant([1234, -5678], tf.int32)

        def both():
            whole = tf.nn.experimental.stateless_dropout(x, rate=0.5, seed=seed)
            parts = [dropout_rows(x[a : a + m], 0.5, None, seed, a) for a, m in _CHECKED_PARTS]
            return whole, parts

        try:
            whole, parts = tf.function(both, jit_compile=xla, autograph=False)()
        except (tf.errors.OpError, ValueError, TypeError):  # e.g. no XLA here
            return False
        whole = tf.cast(whole, tf.float32).numpy()
        return all(
            np.array_equal(whole[a : a + m], tf.cast(part, tf.float32).numpy())
            for (a, m), part in zip(_CHECKED_PARTS, parts)
        )


def exact_generators(model):
    """`(generators, names, shared)`: the seed generators of `model` whose
    draws are drawn as the large batch's, the names of the layers holding
    them, and the ids of those whose layer draws one mask for every sample
    (see `WindowDraws`).

    A generator another random layer draws from too is left as Keras runs
    it: started anew at each micro-batch, that layer would draw the same
    numbers in every micro-batch of a window. So is a layer the model's
    functional graph calls on a tensor whose first axis is fixed (not the
    batch's: a time-major tensor)."""
    exact, other, shared, holders = {}, set(), set(), {}
    not_over_samples = _not_over_samples(model)
    for layer in hooks.flatten_layers(model):
        held = held_generators(layer)
        if not draws_exactly(layer) or id(layer) in not_over_samples:
            other.update(id(g) for g in held)
            continue
        for g in held:
            exact.setdefault(id(g), g)
            holders.setdefault(id(g), layer.name)
            if _declares_shared(layer):
                shared.add(id(g))
    kept = [g for key, g in exact.items() if key not in other]
    return kept, [holders[id(g)] for g in kept], shared & {id(g) for g in kept}


class WindowDraws:
    """The window's seeds for the seed generators of `EXACT_LAYERS` layers.

    Args:
        generators: the `keras.random.SeedGenerator`s drawn as the large
            batch's. Make this in the model's distribution strategy scope.
        names: the names of the layers holding them, for messages.
            Defaults to `()`.
        shared: the ids of those generators whose layer draws one mask for
            every sample (a Dropout with `noise_shape=(1, ...)`). Defaults
            to `()`.
    """

    def __init__(self, generators, names=(), shared=()):
        self.generators = list(generators)
        self.names = list(names)
        self.ids = frozenset(id(g) for g in self.generators)
        self.shared = frozenset(shared)
        with hooks.autocast(None):
            self.starts = [
                replica_local_variable(g.state.value, f"window_seed_{i}", g.state.dtype)
                for i, g in enumerate(self.generators)
            ]
        # Draws whose tensor's first axis turned out not to be the
        # micro-batch's samples (not known at trace time): masks of their
        # own; read after each epoch (`unexact_draws`).
        self.mismatches = replica_local_variable(0, "window_draw_mismatches", tf.int64)
        self.mismatches_read = 0
        self.checks_at_run_time = False  # whether a trace counts them
        self.warned = set()
        self.first_sample = self.samples = self.samples_static = None

    @property
    def layer_names(self):
        """The names of the layers holding the generators, each once (for
        messages)."""
        return list(dict.fromkeys(self.names))

    @classmethod
    def for_model(cls, model):
        """The model's `WindowDraws`, or None when no layer draws exactly
        (`exact_generators`)."""
        kept, names, shared = exact_generators(model)
        return cls(kept, names, shared) if kept else None

    @contextlib.contextmanager
    def drawing(self, window_start, first_sample, samples, samples_static):
        """Around a micro-batch's forward and backward pass: its generators
        start from the window's state (kept at the window's first
        micro-batch, `window_start`, a bool tensor, even if that one is
        dropped as non-finite), and their Dropout draws are its rows of the
        window's (`first_sample`: samples added to the window before this
        micro-batch; `samples`: its own, an int64 tensor, and
        `samples_static`, an int or None). Call before the forward pass
        reads the generators (a recomputed block keeps them as read)."""
        with hooks.autocast(None):
            for g, start in zip(self.generators, self.starts):
                start.assign(tf.where(window_start, g.state.value, start.read_value()))
                g.state.assign(start.read_value())
        hooks.route_backend_dropout(_route)  # outside a window: Keras' own draw
        previous = getattr(_LOCAL, "window", None)
        self.first_sample, self.samples, self.samples_static = first_sample, samples, samples_static
        _LOCAL.window = self
        self.routed = {id(g): 0 for g in self.generators}
        try:
            with _counting_draws(self.generators) as drawn:
                yield
            self._warn_other_draws(drawn)
        finally:
            _LOCAL.window = previous

    def _warn_other_draws(self, drawn):
        """Warns (once per layer) where a generator was drawn from in this
        trace more often than its Dropout draws took from it: a draw of
        another kind (`keras.random.*` given the Dropout's generator), which
        starts every micro-batch from the window's state too, so repeats
        its numbers in each micro-batch of a window."""
        for g, name in zip(self.generators, self.names):
            extra = drawn[id(g)] - self.routed[id(g)]
            if extra > 0 and ("other", name) not in self.warned:
                self.warned.add(("other", name))
                warnings.warn(
                    f"accumulate_steps: the seed generator of layer {name!r} was "
                    f"drawn from {extra} time(s) in a micro-batch besides its "
                    "Dropout draws (keras.random.* given that generator). Each "
                    "micro-batch of a window starts it from the window's state, so "
                    "those draws give the same numbers in every micro-batch of a "
                    "window, not one draw for the large batch. Give those draws a "
                    "SeedGenerator of their own.",
                    stacklevel=3,
                )

    def unexact_draws(self, strategy):
        """The draws since the last call that ran `own_dropout` because
        their tensor's first axis was not the samples (a host read, where
        a trace counts them; else 0)."""
        if not self.checks_at_run_time:
            return 0
        total = int(strategy.experimental_local_results(self.mismatches)[0].numpy())
        new, self.mismatches_read = total - self.mismatches_read, total
        return new

    def refusal(self, inputs, rate, first, shared):
        """Why this draw cannot be the large batch's rows, or None (`first`:
        `_first_noise_axis`)."""
        dtype = tf.as_dtype(inputs.dtype).name
        if not isinstance(rate, numbers.Real):
            return "a rate given as a tensor"
        xla = hooks.in_xla_context()
        if not draws_rows_exactly(dtype, xla):
            return f"{dtype} draws{' under XLA' if xla else ''} on this TensorFlow"
        if shared or first is None:
            return None
        if self.samples_static is None or first != self.samples_static:
            # A fixed axis is not that of a batch of no fixed size either.
            return (
                f"a tensor of shape {tuple(inputs.shape)}, whose first axis is not "
                f"the micro-batch's {self.samples_static or 'varying'} samples"
            )
        return None

    def warn(self, reason):
        """Warns, once per `reason`, that a draw was not the large batch's."""
        if reason in self.warned:
            return
        self.warned.add(reason)
        warnings.warn(
            f"accumulate_steps: a Dropout draw with {reason} is drawn for each "
            "micro-batch with a seed of its own (the window's, folded with "
            "where the micro-batch starts), not as the large-batch step would "
            "draw it (its rows of the window's mask): the weights differ from "
            "one large-batch step with the same seed by that randomness.",
            stacklevel=2,
        )


_COUNTING_LOCK = threading.Lock()
_COUNTING_USERS = {}  # id(generator): the drawings counting its draws now


@contextlib.contextmanager
def _counting_draws(generators):
    """Counts, by generator id, the draws (`next()`, which every keras.random
    draw with a SeedGenerator calls) from `generators` inside it, in this
    thread only (the un-boosted model shares the layers; two boosted models
    may trace at once): at trace time, where the Python runs. One wrapper
    per generator, on the instance while any drawing counts it."""
    counts = {id(g): 0 for g in generators}
    with _COUNTING_LOCK:
        for g in generators:
            if not _COUNTING_USERS.get(id(g)):
                g.next = functools.partial(_counted_next, g)
            _COUNTING_USERS[id(g)] = _COUNTING_USERS.get(id(g), 0) + 1
    previous = getattr(_LOCAL, "counts", None)
    _LOCAL.counts = counts
    try:
        yield counts
    finally:
        _LOCAL.counts = previous
        with _COUNTING_LOCK:
            for g in generators:
                _COUNTING_USERS[id(g)] -= 1
                if not _COUNTING_USERS[id(g)]:
                    del _COUNTING_USERS[id(g)]
                    vars(g).pop("next", None)  # the class's own again


def _counted_next(generator, *args, **kwargs):
    """`generator.next(...)`, counted in this thread's drawing."""
    counts = getattr(_LOCAL, "counts", None)
    if counts is not None and id(generator) in counts:
        counts[id(generator)] += 1
    return type(generator).next(generator, *args, **kwargs)


def drawing_now():
    """Whether a window's `drawing` is active in this thread."""
    return getattr(_LOCAL, "window", None) is not None


def _route(original, inputs, rate, noise_shape, seed):
    """`hooks.route_backend_dropout`'s route: Keras' draw but inside a
    window's `drawing`, for its generators."""
    window = getattr(_LOCAL, "window", None)
    if (
        window is None
        or not isinstance(seed, keras.random.SeedGenerator)
        or id(seed) not in window.ids
        or (isinstance(rate, numbers.Real) and not 0 < rate < 1)  # Keras draws nothing
    ):
        return original(inputs, rate, noise_shape=noise_shape, seed=seed)
    # One mask for every sample where the layer declares it (SpatialDropout
    # passes the batch's size, 1 at a micro-batch of one sample).
    first = _first_noise_axis(inputs, noise_shape)
    shared = id(seed) in window.shared and first == 1
    reason = window.refusal(inputs, rate, first, shared)
    window.routed[id(seed)] += 1
    drawn = hooks.keras_dropout_seed(seed)  # the generator moves on once, as in Keras
    if reason is not None:
        window.warn(reason)
        return own_dropout(inputs, rate, noise_shape, drawn, window.first_sample)
    if shared or first is not None:
        return dropout_rows(inputs, rate, noise_shape, drawn, window.first_sample, shared)
    window.checks_at_run_time = True
    # The first axis is known at run time only (a batch of no fixed size):
    # where it is not the samples, a mask of its own, counted (an assert
    # would do nothing under XLA).
    x = tf.convert_to_tensor(inputs)
    over_samples = tf.equal(_shape_tensor(hooks.keras_noise_shape(x, noise_shape))[0],
                            window.samples)
    window.mismatches.assign_add(tf.cast(tf.logical_not(over_samples), tf.int64))
    return tf.cond(
        over_samples,
        lambda: dropout_rows(x, rate, noise_shape, drawn, window.first_sample),
        lambda: own_dropout(x, rate, noise_shape, drawn, window.first_sample),
    )


def _not_over_samples(model):
    """The ids of the layers that a functional graph of `model` (its own, or
    a functional model's or `Sequential`'s inside it) calls on a first
    input whose first axis is fixed and not the graph's batch size (None,
    unless its `keras.Input` fixes it)."""
    found = set()
    for owner in hooks.flatten_layers(model):
        graph = hooks.layer_graph(owner)
        if graph is None:
            continue
        batch = next(iter(t.shape[0] for t in tf.nest.flatten(graph.inputs) if t.shape), None)
        for layer, inputs, _ in hooks.functional_nodes(graph):
            first = next(iter(tf.nest.flatten(inputs)), None)
            if first is not None and first.shape and first.shape[0] not in (None, batch):
                found.add(id(layer))
    return found


def _declares_shared(layer):
    """Whether `layer` (a Dropout) draws one mask for every sample: its
    `noise_shape` starts with 1."""
    noise_shape = getattr(layer, "noise_shape", None)
    return bool(noise_shape) and noise_shape[0] == 1


def _first_noise_axis(inputs, noise_shape):
    """The noise's first axis, where fixed at trace time (else None):
    `noise_shape`'s when an int there (SpatialDropout passes the batch's
    size, an int or a tensor), else the input's."""
    first = None if noise_shape is None else noise_shape[0]
    return first if isinstance(first, int) else inputs.shape[0]
