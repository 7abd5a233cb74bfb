"""Depthwise convolutions written as grouped `Conv2D`s, run another way
(`compile(depthwise="native")` or `compile(depthwise="chunked")`).

A `keras.layers.Conv2D` with `groups` equal to its input channels (ConvNeXt's
7x7 convolutions) is a depthwise convolution. On the TensorFlow backend,
Keras runs every grouped convolution as an XLA-compiled function (the CPU
`Conv2D` kernel has no groups), and XLA on a CPU computes its filter
gradient through a dense `(kh, kw, C, C)` filter: on ConvNeXtTiny (64x64
inputs, batch 16, this project's 2-core CPU) a 220 MiB temporary in each
stage-3 block's backward, which sets the training peak, and a step 4.5x
as long as with `tf.nn.depthwise_conv2d` computing the same convolution
(`benchmarks/bench_depthwise.py`).

With `compile(depthwise=None)` (the default) and recompute on, the plan
runs "chunked" where it serves (no XLA, a CPU:
`plan._decide_depthwise`); `depthwise="keras"` keeps Keras' way.

"native" runs `tf.nn.depthwise_conv2d`, which sums in another order: values
equal Keras' to float rounding, not bit for bit. "chunked" runs Keras' own
grouped convolution on slices of at most `CHUNK_CHANNELS` channels, whose
dense filters are (C / chunk)^2 times smaller; each output channel is
computed by the same XLA convolution, and the results, checked bit for bit
against Keras' unsliced convolution on this machine at each layer's first
trace (`_bitwise_equal`), are Keras' own. Where a split's check differs
the next of `chunk_splits` is checked. A trace whose batch has no fixed
size runs the slices at the batch sizes checked only. A layer whose
checks all differ, or in a step XLA compiles, runs as Keras runs it, with
a warning. Layers neither can serve (channels_first; for "native" unequal
strides, a stride with a dilation; for "chunked" a depth multiplier,
where the weights were not bit for bit Keras'; a class with a
`convolution_op` of its own) run as Keras runs them; `eligible` says why.
Under a mixed policy the kernel variable is read as stored and each
slice's part cast where Keras' convolution reads it, inside its XLA
function, as Keras' variable is (`_CastOnRead`).
"""

import math
import os
import threading
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_gradboost import cpu_threads
from keras_gradboost import hooks
from keras_gradboost import kernel_choice
from keras_gradboost import precision
from keras_gradboost import wrappers

SETTINGS = (None, "keras", "native", "chunked")
# "chunked": the most channels in one slice. A slice's dense filter is
# (kh, kw, 96, 96), 1.7 MiB in float32 at 7x7; on this project's CPU the
# step's convolutions ran as fast at 48 channels, slower at 8 (more calls),
# and each slice adds an XLA compilation at the first step.
CHUNK_CHANNELS = 96
# Where the even split's check differs, splits into whole multiples of this
# many channels are tried next: on this project's CPU 98 channels in [49, 49]
# gave another filter gradient than Keras' and [48, 50] its own, and every
# such split tried of 97 to 390 channels was equal (benchmarks/RESULTS.md).
# Slices of under 8 channels differed at 7x7 kernels.
ALIGNED_CHANNELS = 48


def check_setting(value):
    """Raises if `value` is not an accepted `depthwise` compile argument."""
    return kernel_choice.check_setting(
        "depthwise", value, SETTINGS,
        'None (as Keras runs them; with recompute on, "chunked" where it '
        'runs bit for bit), "keras" (grouped convolutions run as Keras runs '
        'them), "native" (a '
        "Conv2D whose groups equal its input channels runs TensorFlow's "
        'depthwise kernel) or "chunked" (Keras\' own grouped convolution on '
        "slices of its channels)",
    )


def eligible(layer, setting="native"):
    """Whether `layer` is a depthwise convolution written as a grouped
    `Conv2D` that `setting` ("native" or "chunked") computes (for an
    unbuilt layer, whether its groups equal its input channels is checked
    at each call).

    Returns:
        `(True, None)`, or `(False, reason)`.
    """
    if not isinstance(layer, keras.layers.Conv2D) or layer.groups == 1:
        return False, "not a grouped Conv2D"
    if kernel_choice.keeps_own_convolution(layer):
        return False, "its class overrides convolution_op"
    if layer.built and layer.kernel.shape[-2] != 1:
        return False, "its groups are not its input channels"
    if layer.data_format != "channels_last":
        return False, "channels_first"
    if setting == "chunked":
        if layer.filters != layer.groups:
            return False, f"a depth multiplier of {layer.filters // layer.groups}"
        if layer.groups <= CHUNK_CHANNELS:
            return False, f"at most {CHUNK_CHANNELS} channels, one slice already"
        return True, None
    strides, dilation = tuple(layer.strides), tuple(layer.dilation_rate)
    if strides[0] != strides[1]:
        return False, f"unequal strides {strides}"
    if max(strides) > 1 and max(dilation) > 1:
        return False, f"strides {strides} with dilation {dilation}"
    return True, None


def candidates(model, setting="native"):
    """The layers of `model` that `depthwise=setting` runs its way."""
    return kernel_choice.eligible_layers(model, lambda layer: eligible(layer, setting))


def chunk_sizes(channels):
    """The slices "chunked" cuts `channels` into first: as few as keep each
    at most `CHUNK_CHANNELS`, as even as can be (each of at least 2
    channels, so Keras runs every slice as a grouped convolution)."""
    count = -(-channels // CHUNK_CHANNELS)
    base, extra = divmod(channels, count)
    return [base + 1] * extra + [base] * (count - extra)


def chunk_splits(channels):
    """The splits of `channels` "chunked" tries in turn, the first whose
    check passes running: `chunk_sizes`, then slices of whole multiples of
    `ALIGNED_CHANNELS` (the last takes the rest), as many and one more,
    each of at most `CHUNK_CHANNELS`."""
    splits = [chunk_sizes(channels)]
    unit = ALIGNED_CHANNELS
    whole = channels // unit
    for count in (len(splits[0]), len(splits[0]) + 1):
        if whole < count:
            break
        base, extra = divmod(whole, count)
        sizes = [(base + 1) * unit] * extra + [base * unit] * (count - extra)
        sizes[-1] += channels - whole * unit
        if max(sizes) <= CHUNK_CHANNELS and min(sizes) >= 2 and sizes not in splits:
            splits.append(sizes)
    return splits


class _Depthwise:
    """A `convolution_op` wrapper: the layer's `setting` ("native" or
    "chunked") inside `kernel_choice.running(...)` for this layer, Keras'
    own convolution elsewhere (the layer may also belong to the un-boosted
    model). One per layer: the last `apply` sets its setting.

    For "chunked": `check_batches`, the batch sizes a trace whose batch is
    not fixed is checked at (`set_check_batches`; else 2), the only sizes
    it runs the slices at; `sliced`, whether the last trace ran slices
    (None before one), which the estimates follow, and `sizes`, the split
    it ran (None before one); `warned`, the reasons a warning has named."""

    def __init__(self, layer):
        self.layer = layer
        self.setting = "native"
        self.chosen_by = None  # what chose the setting, if not compile(depthwise=)
        self.owner = None  # a weak reference to the model whose compile set it
        self.check_batches = ()
        self.sliced = None
        self.sizes = None
        self.warned = set()

    def __call__(self, original, inputs, kernel):
        layer = self.layer
        channels = inputs.shape[-1]
        if (
            id(layer) not in kernel_choice.current()
            or len(inputs.shape) != 4
            or channels != layer.groups  # an unbuilt layer's groups < channels
        ):
            return original(inputs, kernel)
        if self.setting == "chunked":
            return self._chunked(original, inputs, kernel)
        multiplier = kernel.shape[-1] // channels
        # Keras' grouped kernel (kh, kw, 1, C * m), output c * m + j from
        # input c, is the depthwise kernel (kh, kw, C, m).
        depthwise_kernel = tf.reshape(kernel, tuple(kernel.shape[:2]) + (channels, multiplier))
        return tf.nn.depthwise_conv2d(
            inputs,
            depthwise_kernel,
            strides=(1,) + tuple(layer.strides) + (1,),
            padding=layer.padding.upper(),
            dilations=tuple(layer.dilation_rate),
        )

    def _chunked(self, original, inputs, kernel):
        splits = chunk_splits(inputs.shape[-1])
        if len(splits[0]) == 1 or kernel.shape[-1] != inputs.shape[-1]:
            return original(inputs, kernel)  # not what `eligible` chose
        self.sliced = False
        if hooks.in_xla_context() or xla_clusters():
            # The check, run outside the step, would not vouch for what XLA
            # makes of the slices inside it.
            self._warn("xla", "XLA compiles the step (jit_compile or auto-clustering)")
        elif None in inputs.shape[1:]:
            self._warn("shape", f"its input's shape {tuple(inputs.shape)} is not fixed where "
                       "the step is traced, so the slices cannot be checked against Keras'")
        else:
            batches = (inputs.shape[0],) if inputs.shape[0] else (self.check_batches or (2,))
            stored = _kernel_as_stored(kernel, inputs)
            sizes, equal = self._split(original, inputs, stored, splits, batches)
            if len(equal) < len(batches):
                tried = " or ".join(str(split) for split in splits)
                ran = f"; at batch sizes {equal} it runs the slices {sizes}" if equal else ""
                self._warn("check", f"on this machine its slices ({tried}) did not give "
                           "Keras' values and gradients bit for bit (inputs "
                           f"{tuple(inputs.shape)}, batch sizes "
                           f"{sorted(set(batches) - set(equal))}){ran}")
            if equal:
                self.sliced, self.sizes = True, sizes
                if inputs.shape[0]:
                    return _sliced(original, inputs, stored, sizes)
                # A batch of no fixed size: the slices at the sizes checked,
                # Keras' convolution at any other (one branch runs).
                checked = tf.reduce_any(tf.equal(tf.shape(inputs)[0], equal))
                return tf.cond(
                    checked,
                    lambda: _sliced(original, inputs, stored, sizes),
                    lambda: original(inputs, kernel),
                )
        return original(inputs, kernel)

    def _split(self, original, inputs, kernel, splits, batches):
        """The first of `splits` whose check passes at every one of
        `batches`, else the first that passes at the most (at none: the
        first split), and the batch sizes it passes at."""
        best = (splits[0], [])
        for sizes in splits:
            equal = [b for b in batches if self._checked(original, inputs, kernel, sizes, b)]
            if len(equal) == len(batches):
                return sizes, equal
            if len(equal) > len(best[1]):
                best = (sizes, equal)
        return best

    def _checked(self, original, inputs, kernel, sizes, batch):
        key = (
            batch, tuple(inputs.shape[1:]), tuple(kernel.shape), tuple(sizes),
            tuple(self.layer.strides), self.layer.padding, tuple(self.layer.dilation_rate),
            _dtype(inputs), _stored_dtype(kernel),
        )
        with _CHECKED_LOCK:
            if key not in _CHECKED:
                with tf.init_scope():  # eager, also while a step is traced
                    _CHECKED[key] = _bitwise_equal(
                        original, (batch,) + key[1], kernel.shape, sizes,
                        _dtype(inputs), _stored_dtype(kernel),
                    )
            return _CHECKED[key]

    def _warn(self, reason, why):
        if reason in self.warned:
            return
        self.warned.add(reason)
        chosen = ""
        if self.chosen_by:
            chosen = f" ({self.chosen_by} chose it; depthwise=\"keras\" turns it off)"
        warnings.warn(
            f'depthwise="chunked"{chosen}: layer {self.layer.name!r} runs as Keras '
            f"runs it (one XLA grouped convolution): {why}. depthwise=\"native\" "
            "runs TensorFlow's depthwise kernel instead (equal to float rounding).",
            stacklevel=3,
        )


def xla_clusters():
    """Whether TensorFlow's auto-clustering may compile parts of a step
    with XLA (`tf.config.optimizer.set_jit`, or `TF_XLA_FLAGS` with
    `--tf_xla_auto_jit` on)."""
    if tf.config.optimizer.get_jit():
        return True
    for flag in os.environ.get("TF_XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name.lstrip("-") == "tf_xla_auto_jit" and value not in ("0", "-1", ""):
            return True
    return False


_CHECKED = {}
_CHECKED_LOCK = threading.Lock()  # replicas trace in threads of their own


def _dtype(value):
    """A tensor's or a Keras variable's dtype name."""
    return keras.backend.standardize_dtype(value.dtype)


def _stored_dtype(kernel):
    """The dtype name `kernel` is stored in (a `_CastOnRead`'s stored one)."""
    return keras.backend.standardize_dtype(getattr(kernel, "stored_dtype", kernel.dtype))


class _CastOnRead:
    """A float32 kernel (or a slice of it) that becomes a tensor cast to
    `dtype` where it is read, as a Keras variable does under a mixed policy:
    Keras' convolution reads it inside its XLA function, so the cast is
    there and the kernel's gradient is never rounded to `dtype` (a slice
    cast before the call, as first written, gave weights that differed by
    rounding after 4 bfloat16 steps)."""

    def __init__(self, value, dtype):
        self.value, self.cast_to = value, tf.as_dtype(dtype)
        self.stored_dtype = value.dtype
        # As a Keras variable in a layer's call: its dtype, the cast one.
        self.shape, self.dtype = value.shape, self.cast_to

    def __tf_tensor__(self, dtype=None, name=None):
        if dtype is not None and tf.as_dtype(dtype) != self.cast_to:
            raise ValueError(
                f"A kernel read as {self.cast_to.name} was asked for as "
                f"{tf.as_dtype(dtype).name}."
            )
        return tf.cast(self.value, self.cast_to, name=name)


def _kernel_as_stored(kernel, inputs):
    """`kernel` as the check and `_sliced` take it: a `_CastOnRead` of a
    Keras variable stored in another dtype than the inputs' (read as
    stored; in the layer's call its `dtype` says the dtype it is read cast
    to), else `kernel` itself."""
    if not isinstance(kernel, keras.Variable):
        return kernel
    with hooks.autocast(None):
        stored = tf.convert_to_tensor(kernel)
    if stored.dtype == inputs.dtype:
        return kernel
    return _CastOnRead(stored, inputs.dtype)


def _sliced(original, inputs, kernel, sizes):
    """Keras' convolution on each slice of the channels, concatenated (a
    `_CastOnRead`'s slices cast where Keras' convolution reads them)."""
    if isinstance(kernel, _CastOnRead):
        parts = [_CastOnRead(part, kernel.cast_to) for part in tf.split(kernel.value, sizes, -1)]
    else:
        parts = tf.split(kernel, sizes, axis=-1)
    outputs = [original(part, part_kernel) for part, part_kernel in zip(
        tf.split(inputs, sizes, axis=-1), parts)]
    return tf.concat(outputs, axis=-1)


def _bitwise_equal(original, input_shape, kernel_shape, sizes, dtype="float32",
                   kernel_dtype=None):
    """Whether the slices give Keras' forward and both gradients bit for bit
    (the same bits: -0.0 is not 0.0) on random values of these shapes, the
    inputs in `dtype`. With a `kernel_dtype` other than `dtype` (a mixed
    policy), see `_stored_bitwise_equal`. Drawn with NumPy's own generator:
    TensorFlow's random state is left as it was."""
    if kernel_dtype not in (None, dtype):
        return _in_own_thread(
            _stored_bitwise_equal, original, input_shape, kernel_shape, sizes, dtype,
            kernel_dtype,
        )
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal(tuple(input_shape)), dtype)
    weights = tf.constant(0.1 * rng.standard_normal(tuple(kernel_shape)), dtype)

    def result(run):
        # Graph gradients, not a tape: `tf.init_scope` pauses every tape.
        @tf.function(autograph=False)
        def step(x, weights):
            y = run(x, weights)
            # Every output weighted differently, so each gradient element
            # sums distinct terms.
            y = tf.cast(y, "float32")
            loss = tf.reduce_sum(y * tf.sin(y))
            return [y] + tf.gradients(loss, [x, weights])

        # A concrete function, called directly: tf.function's warning about
        # frequent retracing counts calls of `step` itself.
        traced = step.get_concrete_function(
            tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(weights.shape, weights.dtype)
        )
        return [_bits(t) for t in traced(x, weights)]

    whole = result(original)
    sliced = result(lambda x, weights: _sliced(original, x, weights, sizes))
    return all(np.array_equal(a, b) for a, b in zip(whole, sliced))


def _stored_bitwise_equal(original, input_shape, kernel_shape, sizes, dtype, kernel_dtype):
    """`_bitwise_equal` under a mixed policy, as a layer's call runs: Keras'
    convolution reads a Keras variable stored in `kernel_dtype` under the
    autocast to `dtype` the call sets, the slices take it as
    `_kernel_as_stored` gives it; the kernel's gradient is the variable's."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal(tuple(input_shape)), dtype)
    variable = keras.Variable(0.1 * rng.standard_normal(tuple(kernel_shape)), dtype=kernel_dtype)
    with hooks.autocast(None):
        stored = variable.value  # the variable itself: the gradient's target

    def result(run):
        @tf.function(autograph=False)
        def step(x):
            with hooks.autocast(dtype):
                y = tf.cast(run(x), "float32")
            loss = tf.reduce_sum(y * tf.sin(y))
            return [y] + tf.gradients(loss, [x, stored])

        return [_bits(t) for t in step.get_concrete_function(tf.TensorSpec(x.shape, x.dtype))(x)]

    whole = result(lambda x: original(x, variable))
    sliced = result(lambda x: _sliced(original, x, _kernel_as_stored(variable, x), sizes))
    return all(np.array_equal(a, b) for a, b in zip(whole, sliced))


def _in_own_thread(function, *args):
    """`function(*args)` in a new thread: outside any distribution strategy
    or trace of the caller's (replicas trace in threads of their own), so
    it can make a Keras variable and run eagerly."""
    outcome = {}

    def run():
        try:
            outcome["value"] = function(*args)
        except BaseException as error:  # raised in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="keras_gradboost_depthwise_check")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _bits(tensor):
    """A tensor's values as unsigned integers of the same width."""
    array = tensor.numpy()
    return array.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[array.dtype.itemsize])


def apply(layers, setting="native", chosen_by=None, owner=None):
    """Marks `layers` (from `candidates`) to run as `setting` says inside
    `kernel_choice.running` (idempotent; the marks do nothing outside it).
    A layer is marked once, for every model that holds it: one marked for
    another setting by another model's compile (`owner`: the model
    compiled; boosted models share the layers of the model given to
    `boost()`) takes this one, with a warning. `chosen_by` names what chose
    `setting` where the user did not (`recompute="auto"`), for the warnings.

    Returns:
        A frozenset of their ids, for `kernel_choice.running`.
    """
    before = {id(layer): _marked(layer) for layer in layers}
    ids = kernel_choice.mark(layers, _Depthwise)
    changed = []
    for layer in layers:
        wrapper = _wrapper(layer)
        old_setting, old_owner = before[id(layer)]
        if old_setting not in (None, setting) and old_owner not in (None, owner):
            changed.append(layer.name)
        wrapper.setting = setting
        wrapper.chosen_by = chosen_by
        wrapper.owner = weakref.ref(owner) if owner is not None else None
        wrapper.sliced = wrapper.sizes = None
        wrapper.warned = set()  # a new compile traces anew, and warns anew
    if changed:
        chosen = f" ({chosen_by} chose it)" if chosen_by else ""
        warnings.warn(
            f"depthwise={setting!r}{chosen}: {len(changed)} layer(s) (e.g. "
            f"{changed[0]!r}) were compiled with another depthwise setting by "
            f"another model; the layers now run {setting!r} in every boosted "
            "model that holds them.",
            stacklevel=4,  # apply <- _apply_plan <- compile <- the caller
        )
    return ids


def _marked(layer):
    """`(setting, model)` of the compile that marked `layer` last (the
    model None once it is gone), or `(None, None)`."""
    wrapper = _wrapper(layer)
    if wrapper is None:
        return None, None
    return wrapper.setting, wrapper.owner() if wrapper.owner else None


def set_check_batches(layers, sizes):
    """The batch sizes at which "chunked" checks a layer of `layers` whose
    traced batch is not fixed (`fit`'s batches, each replica's share)."""
    batches = tuple(sorted({int(size) for size in sizes if size}))
    for layer in layers:
        wrapper = _wrapper(layer)
        if wrapper is not None:
            wrapper.check_batches = batches


def runs_sliced(layer):
    """Whether `layer` runs in slices here ("chunked", and its last trace
    ran them; before any trace, whether it is marked to)."""
    return _setting_here(layer) == "chunked" and _wrapper(layer).sliced is not False


def _setting_here(layer):
    """The setting `layer` runs here (inside `kernel_choice.running` for
    it), or None for Keras' way."""
    if id(layer) not in kernel_choice.current():
        return None
    wrapper = _wrapper(layer)
    return None if wrapper is None else wrapper.setting


def _wrapper(layer):
    """The layer's `_Depthwise` wrapper, or None."""
    for found in wrappers.patches(layer, "convolution_op"):
        if isinstance(found.around, _Depthwise):
            return found.around
    return None


# XLA's CPU backward of a depthwise convolution that Keras runs as a grouped
# convolution (multiplier 1) holds about this many float32 copies of the
# dense (kh, kw, C, C) filter at once: it added 1.9-2.0 of them to the
# training peak of ConvNeXtTiny and of a one-convolution model, in requested
# bytes (2.0-2.4 for the layer's gradient alone; float32, mixed_bfloat16 and
# mixed_float16 alike: XLA computes them in float32 here). With a
# multiplier of 2 nothing of that size was seen, so only a multiplier of 1
# is counted.
XLA_DENSE_FILTER_COPIES = 2


def temporary_remedy(layer, xla=False):
    """What the plan says of the XLA temporaries of the depthwise
    convolution `layer`: why they are there, and what shrinks or removes
    them (with `xla`, the step XLA compiles: "chunked" would not run)."""
    native = 'compile(depthwise="native") removes them (values equal Keras\' to float rounding)'
    if runs_sliced(layer):
        return (
            '(in slices of its channels, depthwise="chunked": the dense filters '
            "of the slices whose backwards run at once): recompute cannot remove "
            f"them; {native}"
        )
    chunked = ""
    # Not where "chunked" is set and ran Keras' way (it said why).
    if eligible(layer, "chunked")[0] and _setting_here(layer) != "chunked" and not xla:
        chunked = (
            f'compile(depthwise="chunked") makes them (C / {CHUNK_CHANNELS})^2 '
            "times smaller (Keras' values bit for bit); "
        )
    return (
        "(Keras runs it as a grouped convolution; on a CPU its gradient goes "
        "through dense (kh, kw, C, C) filters): recompute cannot remove them; "
        f"{chunked}{native}"
    )


_GROUPED = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)


def xla_backward_temporaries(model):
    """The temporaries of the XLA backward of each depthwise convolution
    Keras runs as a grouped convolution (`Conv1D`/`Conv2D`/`Conv3D` with
    groups = input channels = filters) on a CPU: about
    `XLA_DENSE_FILTER_COPIES` float32 copies of a dense `(k..., C, C)`
    filter (ConvNeXtTiny's last stage: ~220 MiB; measured for `Conv2D`,
    channels_last; the others assumed alike). Layers running natively
    here (`kernel_choice.current()`) have none, and neither has a GPU
    (cuDNN runs grouped convolutions); a layer running in slices
    (`depthwise="chunked"`) has those of its largest slices (of the split
    its last trace ran; before one, the even split), as many at once as
    the executor runs ops (`cpu_threads.inter_op()`). A layer not
    yet built is skipped (the estimates trace the model first, which
    builds it).

    Returns:
        A list of `(layer, bytes)`.
    """
    if precision.gpu_available():
        return []
    found = []
    for layer in hooks.flatten_layers(model, include_self=False):
        if not isinstance(layer, _GROUPED) or layer.groups == 1 or not layer.built:
            continue
        *window, per_group, filters = layer.kernel.shape
        if per_group != 1 or filters != layer.groups or _setting_here(layer) == "native":
            continue
        dense = [filters * filters]
        if runs_sliced(layer):
            # The slices' backwards are independent ops: the executor runs
            # as many at once as it has threads (a 3-slice layer on this
            # project's 2 cores: the peak held 2 slices' filters).
            sizes = sorted(_wrapper(layer).sizes or chunk_sizes(filters), reverse=True)
            dense = [size * size for size in sizes[: cpu_threads.inter_op()]]
        itemsize = max(4, tf.as_dtype(layer.compute_dtype).size)
        size = XLA_DENSE_FILTER_COPIES * sum(dense) * math.prod(window) * itemsize
        found.append((layer, int(size)))
    return found


def xla_backward_temporary(model):
    """The largest of `xla_backward_temporaries(model)`.

    Returns:
        `(bytes, layer)`, or `(0, None)` when there is none.
    """
    found = xla_backward_temporaries(model)
    layer, size = max(found, key=lambda pair: pair[1], default=(None, 0))
    return size, layer
