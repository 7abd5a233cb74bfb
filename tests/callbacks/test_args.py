"""The callbacks' argument checks: one rule for every argument of every
callback (wrong type -> TypeError, wrong value -> ValueError, both in the
Keras form naming the argument and the value received)."""

import inspect
import re

import pytest

from keras_gradboost.callbacks import GradientAuditor
from keras_gradboost.callbacks import NaNWatcher
from keras_gradboost.callbacks import RetraceCounter
from keras_gradboost.callbacks import StepTimeMonitor
from keras_gradboost.callbacks import args

CALLBACKS = (NaNWatcher, StepTimeMonitor, RetraceCounter, GradientAuditor)

# (callback, argument, a value of the wrong type, other arguments)
WRONG_TYPE = [
    (NaNWatcher, "action", 3, {}),
    (NaNWatcher, "locate", "yes", {}),
    (NaNWatcher, "dump_dir", 3, {}),
    (NaNWatcher, "max_skips", 1.5, {}),
    (NaNWatcher, "max_skips", "3", {}),
    (NaNWatcher, "lr_factor", "0.5", {}),
    (NaNWatcher, "lr_factor", True, {}),
    (NaNWatcher, "verbose", "loud", {}),
    (StepTimeMonitor, "window", 2.5, {}),
    (StepTimeMonitor, "window", True, {}),
    (StepTimeMonitor, "split_at", 1.5, {}),
    (StepTimeMonitor, "log_dir", ["logs"], {}),
    (StepTimeMonitor, "profile_steps", "ab", {"log_dir": "logs"}),
    (StepTimeMonitor, "profile_steps", (1.5, 2), {"log_dir": "logs"}),
    (StepTimeMonitor, "verbose", None, {}),
    (RetraceCounter, "max_retraces", 1.5, {}),
    (RetraceCounter, "strict", "yes", {}),
    (RetraceCounter, "verbose", 1.0, {}),
    (GradientAuditor, "on_missing", None, {}),
    (GradientAuditor, "every_n_steps", "100", {}),
    (GradientAuditor, "zero_checks", 1.5, {}),
    (GradientAuditor, "vanishing_ratio", "1e-4", {}),
    (GradientAuditor, "exploding_ratio", None, {}),
    (GradientAuditor, "show_non_trainable", 1, {}),
    (GradientAuditor, "verbose", [1], {}),
]

# (callback, argument, a value of the right type that is not accepted, others)
WRONG_VALUE = [
    (NaNWatcher, "action", "explode", {}),
    (NaNWatcher, "dump_dir", "", {}),
    (NaNWatcher, "max_skips", 0, {}),
    (NaNWatcher, "lr_factor", 2.0, {}),
    (NaNWatcher, "lr_factor", 0, {}),
    (NaNWatcher, "verbose", 2, {}),
    (StepTimeMonitor, "window", 0, {}),
    (StepTimeMonitor, "split_at", 0, {}),
    (StepTimeMonitor, "split_at", "late", {}),
    (StepTimeMonitor, "log_dir", "", {}),
    (StepTimeMonitor, "profile_steps", (3, 1), {"log_dir": "logs"}),
    (StepTimeMonitor, "profile_steps", (1, 2, 3), {"log_dir": "logs"}),
    (StepTimeMonitor, "profile_steps", (-1, 2), {"log_dir": "logs"}),
    (StepTimeMonitor, "verbose", -1, {}),
    (RetraceCounter, "max_retraces", -1, {}),
    (RetraceCounter, "verbose", 3, {}),
    (GradientAuditor, "on_missing", "stop", {}),
    (GradientAuditor, "every_n_steps", 0, {}),
    (GradientAuditor, "zero_checks", -2, {}),
    (GradientAuditor, "vanishing_ratio", 2, {}),
    (GradientAuditor, "vanishing_ratio", 0.0, {}),
    (GradientAuditor, "exploding_ratio", 0.5, {}),
    (GradientAuditor, "verbose", 5, {}),
]

# Arguments whose every value of the right type is accepted.
NO_WRONG_VALUE = {
    (NaNWatcher, "locate"),
    (RetraceCounter, "strict"),
    (GradientAuditor, "show_non_trainable"),
}


def _ids(cases):
    return [f"{cls.__name__}-{name}={value!r}" for cls, name, value, _ in cases]


@pytest.mark.parametrize("cls, name, value, others", WRONG_TYPE, ids=_ids(WRONG_TYPE))
def test_a_wrong_type_raises_type_error(cls, name, value, others):
    with pytest.raises(TypeError) as info:
        cls(**others, **{name: value})
    expected = (
        f"Invalid type for argument `{name}`. Received: {name}={value!r} of "
        f"type {type(value).__name__}. Expected "
    )
    assert str(info.value).startswith(expected), str(info.value)


@pytest.mark.parametrize("cls, name, value, others", WRONG_VALUE, ids=_ids(WRONG_VALUE))
def test_a_wrong_value_raises_value_error(cls, name, value, others):
    with pytest.raises(ValueError) as info:
        cls(**others, **{name: value})
    assert not isinstance(info.value, TypeError)
    expected = f"Invalid value for argument `{name}`. Received: {name}={value!r}. Expected "
    assert str(info.value).startswith(expected), str(info.value)


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_every_argument_has_a_wrong_type_and_a_wrong_value_case(cls):
    names = set(inspect.signature(cls.__init__).parameters) - {"self"}
    typed = {name for c, name, _, _ in WRONG_TYPE if c is cls}
    valued = {name for c, name, _, _ in WRONG_VALUE if c is cls}
    assert typed == names
    assert valued == names - {name for c, name in NO_WRONG_VALUE if c is cls}


def test_the_lr_factor_bug_names_the_argument():
    # It used to fail with Python's "'<' not supported between instances".
    with pytest.raises(TypeError, match=re.escape("Received: lr_factor='0.5' of type str")):
        NaNWatcher(lr_factor="0.5")


def test_a_wrong_type_is_a_type_error_only():
    with pytest.raises(TypeError, match="window=2.5") as info:
        StepTimeMonitor(window=2.5)
    assert not isinstance(info.value, ValueError)
    assert issubclass(args.ArgumentTypeError, TypeError)


@pytest.mark.parametrize(
    "check, value, expected",
    [
        (lambda v: args.check_int("n", v, minimum=0, allow_none=True), None, None),
        (lambda v: args.check_int("n", v, minimum=1), 3, 3),
        (lambda v: args.check_number("r", v, above=0, below=1), 0.25, 0.25),
        (lambda v: args.check_number("r", v, above=1), 7, 7.0),
        (lambda v: args.check_choice("c", v, ("a", "b")), "b", "b"),
        (args.check_verbose, True, 1),
        (lambda v: args.check_directory("d", v), None, None),
        (lambda v: args.check_int_pair("p", v), [0, 0], (0, 0)),
    ],
)
def test_accepted_values_come_back_normalised(check, value, expected):
    result = check(value)
    assert result == expected and type(result) is type(expected)


def test_accepted_arguments_are_kept():
    watcher = NaNWatcher(action="skip", max_skips=3, lr_factor=0.25, verbose=0)
    assert (watcher.action, watcher.max_skips, watcher.lr_factor) == ("skip", 3, 0.25)
    monitor = StepTimeMonitor(window=5, split_at=None, log_dir="logs", profile_steps=[1, 2])
    assert (monitor.window, monitor.split_at, monitor.profile_steps) == (5, None, (1, 2))
    auditor = GradientAuditor(vanishing_ratio=1e-3, exploding_ratio=100)
    assert auditor.exploding_ratio == 100.0 and auditor.vanishing_ratio == 1e-3
    assert RetraceCounter(max_retraces=0, strict=True).max_retraces == 0
