"""Every ```python example in the public docstrings runs as written.

The public names are those exported by `keras_gradboost` and
`keras_gradboost.callbacks` (classes with their own methods, functions, and
the public functions of exported modules), plus `data.bucket_by_length`.
Each example runs in a fresh namespace: it imports what it uses and builds
its own tiny model and data.
"""

import inspect
import re
import warnings

import pytest

import keras
import keras_gradboost
from keras_gradboost import callbacks
from keras_gradboost import data

_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _own(obj):
    return getattr(obj, "__module__", "").startswith("keras_gradboost")


def _members(module):
    for name in getattr(module, "__all__", None) or dir(module):
        if name.startswith("_"):
            continue
        obj = getattr(module, name)
        if inspect.ismodule(obj):
            if obj.__name__.startswith("keras_gradboost.") and obj is not callbacks:
                yield from (
                    (f"{obj.__name__}.{n}", f)
                    for n, f in vars(obj).items()
                    if not n.startswith("_") and inspect.isfunction(f) and _own(f)
                )
        elif _own(obj):
            yield f"{module.__name__}.{name}", obj


def _documented():
    objects = dict(_members(keras_gradboost))
    objects.update(_members(callbacks))
    objects["keras_gradboost.data.bucket_by_length"] = data.bucket_by_length
    for name, obj in list(objects.items()):
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and inspect.isfunction(member):
                    objects[f"{name}.{attr}"] = member
    return objects


def _examples():
    cases = []
    for name, obj in sorted(_documented().items()):
        # The object's own docstring (a method's is not inherited from Keras).
        for i, block in enumerate(_BLOCK.findall(inspect.cleandoc(obj.__doc__ or ""))):
            cases.append(pytest.param(block, id=f"{name}[{i}]"))
    return cases


EXAMPLES = _examples()


def test_the_public_examples_are_found():
    ids = {case.id.rsplit("[", 1)[0] for case in EXAMPLES}
    expected = {
        "keras_gradboost.GradBoostModel",
        "keras_gradboost.boost",
        "keras_gradboost.callbacks.BackupAndRestore",
        "keras_gradboost.callbacks.NaNWatcher",
        "keras_gradboost.callbacks.StepTimeMonitor",
        "keras_gradboost.callbacks.RetraceCounter",
        "keras_gradboost.callbacks.GradientAuditor",
        "keras_gradboost.data.bucket_by_length",
        "keras_gradboost.tracing.uninstall",
    }
    assert expected <= ids


@pytest.mark.parametrize("source", EXAMPLES)
def test_example_runs_as_written(source):
    policy = keras.config.dtype_policy().name
    keras.utils.set_random_seed(0)
    with warnings.catch_warnings():
        # Some examples show a callback's warning (that is their point).
        warnings.simplefilter("ignore", UserWarning)
        exec(compile(source, "<docstring example>", "exec"), {"__name__": "example"})
    assert keras.config.dtype_policy().name == policy  # nothing leaks
