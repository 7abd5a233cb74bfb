"""Data for a saved model's inputs, for `keras-gradboost compare`: random
batches shaped as each input asks, integer ids within the range of the
layer that looks them up, and `--data` archives with one array per input.

A model's inputs keep their structure (one tensor, a list, a dict): a list
becomes a tuple, because `tf.data.Dataset.from_tensor_slices` stacks a list
into one tensor (every row failed on a two-input MLP, and on a saved BERT:
"Dimensions 3 and 80 are not compatible").
"""

import numpy as np

import keras

from keras_gradboost import hooks
from keras_gradboost.precision_ids import INDEX_LAYERS

# Unknown dimensions of an input (a sequence length) are set to this, or
# the longest shorter power of two the model accepts.
UNKNOWN_DIM = 16


def input_structure(model):
    """`model`'s inputs as it takes them: a KerasTensor, or a tuple or dict
    of them."""
    structure = getattr(model, "input", None) if hooks.is_functional(model) else None
    if structure is None:
        structure = model.inputs if len(model.inputs) > 1 else model.inputs[0]
    if isinstance(structure, list):
        structure = tuple(structure)
    return structure


def inputs(model, samples, notes, rng):
    """Random inputs for every input of `model` (unknown dims become 16).

    Integer inputs, and float inputs that an `Embedding` (or another index
    layer) reads as ids, are drawn in `[0, input_dim)` of the smallest
    `Embedding` that consumes them; an integer input no `Embedding` consumes
    is drawn in `[0, 2)`, and one named like a mask is all ones (no
    padding). Each choice is added to `notes`.

    Returns:
        Arrays in the structure of `input_structure(model)`.
    """
    structure = input_structure(model)
    ranges = index_ranges(model)
    unknown = [UNKNOWN_DIM]

    def draw(tensor, samples=samples, quiet=False):
        name = getattr(tensor, "name", "input")
        shape = [unknown[0] if d is None else d for d in tensor.shape[1:]]
        if None in tensor.shape[1:] and not quiet:
            notes.append(f"input {name}: unknown dims set to {unknown[0]}")
        dtype = str(tensor.dtype)
        high = ranges.get(id(tensor))
        if high is None and "int" in dtype:
            if "mask" in name:
                if not quiet:
                    notes.append(f"input {name}: all ones (no padding)")
                return np.ones((samples, *shape), dtype)
            high = 2
            if not quiet:
                notes.append(f"input {name}: integers in [0, 2) (no Embedding reads it)")
        if high is not None:
            return rng.integers(0, high, size=(samples, *shape)).astype(dtype)
        return rng.normal(size=(samples, *shape)).astype(dtype if "float" in dtype else "float32")

    def probe(length):
        unknown[0] = length
        return keras.tree.map_structure(lambda t: draw(t, samples=1, quiet=True), structure)

    if any(None in t.shape[1:] for t in keras.tree.flatten(structure)):
        unknown[0] = _fitting_length(model, probe)
    return keras.tree.map_structure(draw, structure)


def _fitting_length(model, probe, longest=UNKNOWN_DIM):
    """The longest unknown dimension, halving from `longest`, that `model`
    accepts on one sample (a keras-hub backbone refuses sequences longer
    than its `max_sequence_length`)."""
    length = longest
    while length > 1:
        try:
            model(probe(length))
            return length
        except Exception:  # noqa: BLE001 - any refusal: try shorter
            length //= 2
    return 1


def index_ranges(model):
    """`{id(input KerasTensor): input_dim}` for the inputs of `model` that
    an index layer reads: the smallest `input_dim` among the `Embedding`s
    that consume each (directly, through layers without weights, inside a
    nested functional model, or inside a layer that holds an `Embedding`,
    as keras-hub's `TokenAndPositionEmbedding`)."""
    ranges = {}
    for tensor in model.inputs if hooks.is_functional(model) else []:
        high = _reading_range(model, tensor, depth=0)
        if high is not None:
            ranges[id(tensor)] = high
    return ranges


def _reading_range(model, tensor, depth):
    if depth > 8:
        return None
    found = []
    for layer, ins, outs in hooks.functional_nodes(model):
        positions = [i for i, t in enumerate(ins) if t is tensor]
        if not positions:
            continue
        if isinstance(layer, keras.layers.Embedding):
            found.append(layer.input_dim)
        elif hooks.is_functional(layer):
            inner = layer.inputs
            for i in positions:
                if i < len(inner):
                    found.append(_reading_range(layer, inner[i], depth + 1))
        elif isinstance(layer, INDEX_LAYERS):
            continue  # a lookup or hashing layer reads any value
        elif not layer.weights and len(ins) == 1:
            for out in outs:  # a reshape, a cast: the ids go on
                found.append(_reading_range(model, out, depth + 1))
        else:
            held = [
                l.input_dim
                for l in hooks.flatten_layers(layer, include_self=False)
                if isinstance(l, keras.layers.Embedding)
            ]
            if held:
                found.append(min(held))
    found = [f for f in found if f is not None]
    return min(found) if found else None


def from_archive(model, archive):
    """`(x, y)` from an `.npz` archive: `x` and `y`, or for a model with
    several inputs one array per input, `x_<input name>` (and `y`).

    Raises:
        ValueError: naming the keys found and the keys expected.
    """
    keys = set(archive.files)
    structure = input_structure(model)
    flat = keras.tree.flatten(structure)
    if "y" not in keys:
        raise ValueError(
            f"--data holds {sorted(keys)}; expected an array named 'y' (the targets)."
        )
    if "x" in keys:
        if len(flat) > 1:
            raise ValueError(
                f"--data holds one 'x', but the model takes {len(flat)} inputs: "
                "save one array per input, named "
                + ", ".join(repr(f"x_{_name(t)}") for t in flat)
                + "."
            )
        return archive["x"], archive["y"]
    wanted = {f"x_{_name(t)}": t for t in flat}
    missing = sorted(set(wanted) - keys)
    if missing:
        raise ValueError(
            f"--data holds {sorted(keys)}; expected 'x' (one input) or one "
            f"array per input: {sorted(wanted)} (missing {missing})."
        )
    arrays = {id(t): archive[key] for key, t in wanted.items()}
    x = keras.tree.map_structure(lambda t: arrays[id(t)], structure)
    return x, archive["y"]


def expected_keys(model):
    """The `--data` keys for `model`'s inputs, as `from_archive` reads them."""
    flat = keras.tree.flatten(input_structure(model))
    return ["x"] if len(flat) == 1 else [f"x_{_name(t)}" for t in flat]


def _name(tensor):
    return getattr(tensor, "name", "input").split(":")[0]


def first_rows(x, count):
    """The first `count` rows of every input array."""
    return keras.tree.map_structure(lambda a: a[:count], x)


def rows(x):
    """How many rows the inputs hold (the first input's)."""
    return len(keras.tree.flatten(x)[0])
