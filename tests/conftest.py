"""Test set-up: quiet TensorFlow with allocator statistics, and two logical
CPUs for MirroredStrategy.

The logical device split must happen before TensorFlow initialises its
devices, so it is done here, at collection time, for the whole session.
"""

import gc
import importlib.util
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Allocator statistics and the profiler's memory events on a CPU need
# TensorFlow's BFC allocator, which is the default on some CPUs only (not
# on an AMD EPYC without AVX-512): the peak tests read them.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu,
    [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()],
)

import keras  # noqa: E402

# Tracing a model allocates Python objects by the million: with the default
# thresholds the collector walks its youngest objects every 700 allocations
# and, now and then, every object alive, TensorFlow's and Keras' modules
# among them. Those are frozen out of its walks, and it runs about 70x less
# often (test_nested_graph.py and test_real_models.py: 237 s against 259 on
# 2 cores; a cycle is still freed, later). The peak tests collect before
# they measure (the `requested_peak` fixture).
gc.collect()
gc.freeze()
gc.set_threshold(50000, 20, 20)


@pytest.fixture(scope="module", autouse=True)
def _collect_after_each_module():
    """The models a module left in cycles, freed before the next one: with
    the collector that rare, a worker otherwise held 9.8 GB midway."""
    yield
    gc.collect()


def grappler(disabled):
    """Turns TensorFlow's graph rewrites (grappler) off (`disabled`) or on
    for the functions traced from now on; returns the setting before."""
    before = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": disabled})
    return before.get("disable_meta_optimizer", False)


@pytest.fixture
def no_graph_rewrites():
    """Grappler off for the test (on again after it), in the tests that
    compare two training graphs for exactness: this package's graph against
    plain Keras', or recomputed against not.

    Grappler rewrites a graph by what its backward keeps: it fuses
    MatMul+BiasAdd+Gelu, or folds Dropout's scale into neighbours, only where
    the intermediates are not needed, and under load a pass may time out and
    leave one of two graphs unfused. The two graphs then round differently
    (same maths; in bfloat16 visibly, in float32 at 1e-7, which a few steps
    at learning rate 0.1 can grow past 1e-6). Without grappler both run the
    same ops and must agree exactly: these tests check the package's ops.
    It also saves CI time: on a real architecture, grappler's passes over
    the training graph are about a third of a test's time (MobileNetV3Small
    with pointwise="matmul": 22.6 s with them, 16.2 s without).

    Used only where grappler changes nothing the test checks. It also
    decides what "auto" plans for (with it off, every gradient waits for
    the whole backward: `updates.step_gradients_pile_up`), and a recomputed
    block's weight reads race the optimizer's updates only with it on
    (`mechanism.recomputed`). So outside tests/recompute/ (whose
    `test_under_graph_rewrites_equal_up_to_rounding` checks the default
    set-up), the tests that measure memory, run NaNWatcher's in-graph
    checks or the interaction matrix, or recompute keep it on, as users
    run."""
    before = grappler(True)
    yield
    grappler(before)


def _without_autotune():
    """tf.data autotuning off in every iterator the tests make.

    An autotuned iterator's model thread sleeps for an optimisation period
    that doubles up to 60 s, and deleting the iterator waits for it to wake.
    Keras' fit iterators sit in reference cycles, so the garbage collector
    deletes them minutes later, several at once: a worker of the suite spent
    258 s in such collections (one took 105 s), stalls in whatever test was
    running. Autotuning changes no element or order, only parallelism.
    TensorFlow applies `_apply_debug_options` to a dataset wherever it makes
    an iterator of it (also distributed and multi-device ones).
    """
    from tensorflow.python.data.ops import dataset_ops

    original = getattr(dataset_ops.DatasetV2, "_apply_debug_options", None)
    if original is None:
        raise RuntimeError(
            "tests/conftest.py: tf.data.Dataset._apply_debug_options is gone in "
            f"TensorFlow {tf.__version__}; find where iterators are made now, "
            "or the suite's collections stall on autotune threads again."
        )
    options = tf.data.Options()
    options.autotune.enabled = False

    def apply(self):
        return original(self).with_options(options)

    dataset_ops.DatasetV2._apply_debug_options = apply


_without_autotune()


def _major_minor(version):
    return tuple(int(part) for part in version.split(".")[:2])


KERAS_VERSION = _major_minor(keras.__version__)
TF_VERSION = _major_minor(tf.__version__)


def needs_keras(version, why):
    """Skips a test on a Keras older than `version` (a `(major, minor)`
    tuple) whose reference or set-up is Keras behaviour that came later than
    the oldest supported Keras (`.ci/oldest-constraints.txt`); `why` says
    what differs."""
    return pytest.mark.skipif(
        KERAS_VERSION < version,
        reason=f"needs Keras {version[0]}.{version[1]}: {why}",
    )


# Keras before 3.15 does not track a layer set as an attribute of a
# functional model after the model is built: its variables are not the
# model's trainable variables, so nothing reports them missing a gradient.
needs_layer_set_on_functional = needs_keras(
    (3, 15), "before it, a layer set on a built functional model is not tracked"
)


@pytest.fixture
def regression_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(104, 5)).astype("float32")
    y = rng.normal(size=(104, 3)).astype("float32")
    return x, y


def small_model(cls=keras.Model, regularize=True, seed=0):
    """Dense(8, tanh, l2) -> Dense(3): tiny, with a regularisation loss."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(
        8,
        activation="tanh",
        kernel_regularizer="l2" if regularize else None,
        name="hidden",
    )(inputs)
    outputs = keras.layers.Dense(3, name="out")(hidden)
    return cls(inputs, outputs)


def nested_model():
    """Input(3) -> Sequential "inner" [Dense "inner_dense"] -> Dense "head",
    compiled: a layer nested in a layer, for hooks and wrappers."""
    inputs = keras.Input((3,))
    inner = keras.Sequential([keras.layers.Dense(4, name="inner_dense")], name="inner")
    outputs = keras.layers.Dense(2, name="head")(inner(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    return model


def base_classifier(cls=keras.Model, classes=3, seed=0, frozen=False, training=None):
    """keras.io's transfer learning and fine-tuning: a MobileNetV2 base
    (alpha 0.35, 32x32 inputs, weights=None, no top) called as a layer
    (with `training=` when given), global average pooling and a Dense head
    of `classes` logits; the base frozen with `frozen`."""
    keras.utils.set_random_seed(seed)
    base = keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), include_top=False, weights=None, alpha=0.35
    )
    base.trainable = not frozen
    inputs = keras.Input((32, 32, 3))
    features = base(inputs) if training is None else base(inputs, training=training)
    pooled = keras.layers.GlobalAveragePooling2D()(features)
    return cls(inputs, keras.layers.Dense(classes)(pooled))


def frozen_base_classifier(cls=keras.Model, classes=3, seed=0):
    """`base_classifier` with the base frozen (keras.io's transfer learning)."""
    return base_classifier(cls, classes, seed, frozen=True)


def stateful_rnn_model(cls=keras.Model, batch=4, seed=1):
    """Input((10, 4), batch_size=`batch`) -> LSTM "lstm" (stateful, with
    sequences) -> GRU "gru" (stateful) -> Dense(3), compiled with SGD: a
    forward pass writes state Keras does not list among the model's
    variables (`hooks.untracked_state`)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((10, 4), batch_size=batch)
    hidden = keras.layers.LSTM(8, stateful=True, return_sequences=True, name="lstm")(inputs)
    hidden = keras.layers.GRU(8, stateful=True, name="gru")(hidden)
    return cls(inputs, keras.layers.Dense(3, name="out")(hidden))


def stateful_rnn_data(samples=24):
    rng = np.random.default_rng(0)
    return rng.random((samples, 10, 4), dtype="float32"), np.arange(samples) % 3


def rnn_states(model):
    """The values of every stateful RNN state of `model`."""
    return [
        v.numpy()
        for layer in model.layers
        if isinstance(layer, keras.layers.RNN)
        for v in layer.states
    ]


def max_weight_diff(a, b):
    return max(
        float(np.max(np.abs(wa - wb))) for wa, wb in zip(a.get_weights(), b.get_weights())
    )


_MIRRORED = []


def shared_mirrored_strategy():
    """One MirroredStrategy over the two logical CPUs for the whole session,
    reducing through one device: the collective all-reduces of a second
    strategy in one process can collide with an earlier one's instance keys
    ("Shape mismatch in the collective instance")."""
    if not _MIRRORED:
        devices = tf.config.list_logical_devices("CPU")
        assert len(devices) >= 2, "conftest.py splits the CPU into two devices"
        _MIRRORED.append(
            tf.distribute.MirroredStrategy(
                [d.name for d in devices[:2]],
                cross_device_ops=tf.distribute.ReductionToOneDevice(),
            )
        )
    return _MIRRORED[0]


def kept_for_backward(model, spec):
    """The structural check of recompute: the bytes the backward pass keeps
    from the traced training forward of `model` (a GradBoostModel compiled
    with `recompute=`), `(with its recompute, without any)`; with recompute
    it keeps only the blocks' inputs. `spec`: a batch's `tf.TensorSpec`."""
    from keras_gradboost.recompute import estimate

    setup = model._gradboost.recompute
    without, _, _ = estimate(model, lambda v, p: model(v, training=True), spec, [])
    with_rc, _, _ = estimate(model, lambda v, p: setup.forward(model, v), spec, [])
    return with_rc, without


class SaveAfterBatch(keras.callbacks.Callback):
    """Saves the weights (`save_weights(path)`) at the end of batch `batch`
    of every epoch: mid-window, for the save-and-load tests."""

    def __init__(self, batch, path):
        super().__init__()
        self.batch, self.path = batch, path

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.model.save_weights(self.path)


class InterruptAt(keras.callbacks.Callback):
    """Raises `RuntimeError("interrupted")` at the end of batch `batch` of
    epoch `epoch`: a fit stopped there, for the resume tests."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch, self.ends = epoch, 0

    def on_train_batch_end(self, batch, logs=None):
        # The last batch of the call that ended, counted here: with
        # steps_per_execution > 1, Keras 3.8 passes the call's first batch
        # as `batch`, later versions its last.
        self.ends += 1
        last = self.ends * int(self.model.steps_per_execution) - 1
        if (self.epoch, last) == self.at:
            raise RuntimeError("interrupted")


BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def load_benchmark(name):
    """The module `benchmarks/<name>.py` (the benchmarks are scripts, not a
    package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_matmul_peak(monkeypatch):
    """`keras-gradboost compare` without its matmul-peak subprocess (a
    TensorFlow import, ~5 s of CI), for tests about the rows;
    test_cli.py's test_compare_end_to_end checks the peak."""
    from keras_gradboost import compare

    monkeypatch.setattr(compare, "run_peaks", lambda rows, progress=None: None)


@pytest.fixture
def onednn_convolutions(monkeypatch):
    """Plans estimated as where oneDNN runs the float32 convolutions (the
    default on CPUs with AVX-512): without the im2col buffers of
    TensorFlow's own kernels, which on a CPU without AVX-512 are sized for
    as many images as fit 30 MiB whatever the batch and dwarf a small
    model's activations (MobileNetV2 alpha 0.35 at 32x32, batch 8: a
    training peak estimated at 51.1 MiB for 4.4 MiB of activations, where
    "auto" rightly recomputes only 2 segments). For the tests about which
    blocks a plan takes, so that it is the same on every CPU; what the
    buffers add is tested in recompute/test_setup.py and
    test_applications.py."""
    from keras_gradboost import hooks

    monkeypatch.setattr(hooks, "onednn_enabled", lambda: True)


@pytest.fixture
def requested_peak():
    """`benchmarks/requested_peak.py`: the peak of the bytes a run's
    allocations request (the TensorFlow profiler's memory events). Each run
    starts with a collection: an earlier model's cycles freed during it
    would count as negative bytes, and the collector runs rarely here."""
    module = load_benchmark("requested_peak")
    events = module.memory_events

    def collected_first(run):
        gc.collect()
        return events(run)

    module.memory_events = collected_first  # requested_peak() calls it
    return module
