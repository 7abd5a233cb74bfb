"""Wrapping instance attributes, and holding the batches of a train call.

Several parts of keras_gradboost wrap a method or function of an object for
a while: the callbacks wrap `model.train_function`, the trace-time tracers
`model.train_step` and `optimizer.apply`, NaNWatcher's guard
`optimizer.apply`, recompute a block's `call`, the NaN locator every layer's
`call` during a replay. They all go through `patch`, so they stack: each
wrapper calls what is below it as found at call time, and undoing one in
any order leaves the others working and, once all are undone, exactly what
was there before (the original instance attribute, or none).

The second half wraps a model's train/test/predict function so the batches
of its last call stay reachable (`hold_batches`), built on `patch`.
"""

import itertools

import tensorflow as tf

_ABSENT = object()  # no instance attribute
_PATCH = "_keras_gradboost_patch"  # on an installed function: its Patch
_CHAIN = "_keras_gradboost_chain"  # on a base put in by replace_base


# ------------------------------------------------------------ patch/undo


class _Chain:
    """The wrappers of one attribute, stacked since it held `original`:
    patches (linked from `top` down) over bases (`replace_base`)."""

    def __init__(self, owner, name, original):
        self.owner = owner
        self.name = name
        self.original = original  # the instance attribute before, or _ABSENT
        self.bases = []  # [value] cells put in by replace_base, bottom first
        self.top = None  # the last Patch installed (None: none left)

    def base(self):
        """The raw value under every patch (`_ABSENT`: the class's)."""
        return self.bases[-1][0] if self.bases else self.original

    def base_value(self):
        """What `owner.<name>` is without any patch of this chain."""
        value = self.base()
        return _class_value(self.owner, self.name) if value is _ABSENT else value

    def value(self):
        """What the attribute holds while this chain is in place."""
        return self.base() if self.top is None else self.top.installed

    def restore(self):
        """Sets the attribute to what the chain says it is now."""
        _set(self.owner, self.name, self.value())


class Patch:
    """One wrapper of `owner.<name>`, installed by `patch`. Calling it undoes
    it (a second call does nothing).

    Attributes:
        owner, name: what is wrapped.
        around: the wrapper, `around(below, *args, **kwargs)`.
        installed: the function set as `owner.<name>`.
        active: False once undone.
    """

    def __init__(self, chain, around, passthrough, keep_wrapping):
        self.chain = chain
        self.owner, self.name = chain.owner, chain.name
        self.around = around
        self.active = True
        self.under = chain.top  # the Patch below (None: the chain's base)
        link = self

        def installed(*args, **kwargs):
            below = link.below()
            if link.active or keep_wrapping:
                return around(below, *args, **kwargs)
            if passthrough is not None:
                return passthrough(below, *args, **kwargs)
            return below(*args, **kwargs)

        installed.__name__ = chain.name
        installed.__wrapped__ = self.below()  # inspect.signature sees the original
        setattr(installed, _PATCH, self)
        self.installed = installed

    def below(self):
        """What this wrapper wraps, now: the installed function of the next
        active patch down, or the attribute as it is without any."""
        link = self.under
        while link is not None and not link.active:
            link = link.under
        return link.installed if link is not None else self.chain.base_value()

    def __call__(self):
        """Undoes the patch. On top, it is removed along with the undone
        patches right below it; covered by another wrapper (a patch, or
        something set on the attribute since), it stays as a pass-through:
        a patch above calls past it, anything else that calls it is passed
        on to what is below."""
        if not self.active:
            return
        self.active = False
        chain = self.chain
        if chain.top is not self or _current(self.owner, self.name) is not self.installed:
            return
        top = self.under
        while top is not None and not top.active:
            top = top.under
        chain.top = top
        chain.restore()

    def state(self):
        """Where this patch stands, as far as this module can see:

        - `"wrapping"`: calls of `owner.<name>` go through it;
        - `"covered"`: something this module did not install sits on the
          attribute (or replaced it) and may or may not call it;
        - `"removed"`: undone, or the attribute no longer leads to it.
        """
        if not self.active:
            return "removed"
        met, end = _walk(self.owner, self.name)
        if self in met:
            return "wrapping"
        return "removed" if end is _ABSENT else "covered"

    def __repr__(self):
        state = "active" if self.active else "undone"
        return f"<Patch of {type(self.owner).__name__}.{self.name}: {self.around!r}, {state}>"


def patch(owner, name, around, passthrough=None, keep_wrapping=False):
    """Wraps `owner.<name>` with an instance attribute, undoably.

    Each call of `owner.<name>` calls `around(below, *args, **kwargs)`,
    where `below` is what the attribute would be without this wrapper,
    looked up at that call: the next wrapper down, or the original (the
    instance attribute that was there, or the class attribute). So wrappers
    stack, and each may be undone at any time, in any order: undoing one in
    the middle makes the chain skip it, undoing the top one puts back the
    one below, and undoing the last one restores exactly the state before
    the first (the original instance attribute, or no instance attribute).
    An undo never deletes or overwrites what someone else set on the
    attribute since: the undone wrapper then stays, passing calls on.

    Args:
        owner: the object (a model, a layer, an optimizer, ...).
        name: the attribute, e.g. `"train_step"`.
        around: the wrapper, `around(below, *args, **kwargs)`.
        passthrough: optional `passthrough(below, *args, **kwargs)`: how an
            undone wrapper that is still called passes the call on.
            Defaults to `None`: `below(*args, **kwargs)`.
        keep_wrapping: if True, the undo only takes the wrapper off the
            attribute, and it goes on wrapping for whoever took it while
            it was there (as Keras takes `model.train_step` when it makes a
            train function). Defaults to `False`.

    Returns:
        A `Patch`; call it to undo the wrapping.

    Example:

    ```python
    undo = keras_gradboost.wrappers.patch(
        model, "train_step", lambda step, data: step(data)
    )
    undo()  # model.train_step is the class method again
    ```
    """
    chain = _chain_of(owner, name)
    link = Patch(chain, around, passthrough, keep_wrapping)
    chain.top = link
    setattr(owner, name, link.installed)
    return link


def replace_base(owner, name, new):
    """Puts `new` in place of `base(owner, name)`, under the patches (which
    stay in place and now wrap `new`).

    Replacements stack as patches do: undone in any order, each takes only
    its own `new` away, and once all are undone (with the patches) the
    attribute is what it was before the first.

    Returns:
        A function that takes `new` away again.
    """
    chain = _chain_of(owner, name)
    cell = [new]
    chain.bases.append(cell)
    _tag(new, chain)
    if chain.top is None:
        setattr(owner, name, new)

    def undo():
        if not any(c is cell for c in chain.bases):
            return
        current = _current(owner, name) is chain.value()
        chain.bases = [c for c in chain.bases if c is not cell]
        if current and chain.top is None:
            chain.restore()
        if not any(c[0] is new for c in chain.bases):
            _untag(new, chain)

    return undo


def swap_base(owner, name, old, new):
    """Puts `new` where `old` stands under the patches of `owner.<name>`:
    in the `replace_base` entry that holds it, or as the original value.
    Unlike `replace_base` nothing is added, so whoever put `old` in takes
    `new` away with its own undo.

    Returns:
        Whether `old` was found (nothing changes otherwise).
    """
    chain = _found_chain(owner, name)
    if chain is None:
        if _current(owner, name) is not old:
            return False
        setattr(owner, name, new)
        return True
    cell = next((c for c in chain.bases if c[0] is old), None)
    if cell is not None:
        cell[0] = new
    elif chain.original is old:
        chain.original = new
    else:
        return False
    _untag(old, chain)
    _tag(new, chain)
    if chain.top is None:
        chain.restore()
    return True


def patches(owner, name):
    """The active patches a call of `owner.<name>` goes through, top first
    (as far as the attribute leads through patches: not past something this
    module did not install)."""
    met, _ = _walk(owner, name)
    return [p for p in met if p.active]


def is_patched(function):
    """Whether `function` is one that `patch` installed."""
    return isinstance(getattr(function, _PATCH, None), Patch)


def base(owner, name):
    """`owner.<name>` under every patch: what it would be without them."""
    chain = _found_chain(owner, name)
    return getattr(owner, name) if chain is None else chain.base_value()


def _current(owner, name):
    return vars(owner).get(name, _ABSENT)


def _set(owner, name, value):
    if value is _ABSENT:
        if name in vars(owner):
            delattr(owner, name)
    elif _current(owner, name) is not value:
        setattr(owner, name, value)


def _tags(value):
    tags = getattr(value, "__dict__", None)
    return tags if isinstance(tags, dict) else {}


def _tag(value, chain):
    """Marks a base `value` as `chain`'s, so the chain is found when the
    attribute is that base with no patch on top."""
    try:
        setattr(value, _CHAIN, chain)
    except (AttributeError, TypeError):
        pass  # not markable (a bound method): a later patch starts anew


def _untag(value, chain):
    if _tags(value).get(_CHAIN) is chain:
        delattr(value, _CHAIN)


def _found_chain(owner, name, value=_ABSENT):
    """The chain in place on `owner.<name>` (that made its value), or None."""
    if value is _ABSENT:
        value = _current(owner, name)
    if value is _ABSENT:
        return None
    link = _tags(value).get(_PATCH)
    chain = link.chain if isinstance(link, Patch) else _tags(value).get(_CHAIN)
    if (
        isinstance(chain, _Chain)
        and chain.owner is owner
        and chain.name == name
        and chain.value() is value
    ):
        return chain
    return None


def _settled(owner, name, value):
    """`value` (a past value of `owner.<name>`), or what the undos of its
    wrappers have put in its place since."""
    link = _tags(value).get(_PATCH)
    chain = link.chain if isinstance(link, Patch) else _tags(value).get(_CHAIN)
    if isinstance(chain, _Chain) and chain.owner is owner and chain.name == name:
        return chain.value()
    return value


def _chain_of(owner, name):
    """The chain in place, or a new one over what the attribute holds."""
    chain = _found_chain(owner, name)
    return _Chain(owner, name, _current(owner, name)) if chain is None else chain


def _walk(owner, name):
    """The patches met from the attribute down, undone ones included, and
    where the walk ended: `_ABSENT` (the class attribute) or a value that
    this module did not install."""
    met, chains = [], []
    value = _current(owner, name)
    while True:
        link = _tags(value).get(_PATCH)
        if not isinstance(link, Patch) or link.owner is not owner or link.name != name:
            return met, value
        if any(link.chain is c for c in chains):
            return met, value
        chains.append(link.chain)
        while link is not None:
            met.append(link)
            link = link.under
        value = chains[-1].base()


def _class_value(owner, name):
    """`owner.<name>` as its class provides it (bound, for a method)."""
    for klass in type(owner).__mro__:
        if name in vars(klass):
            value = vars(klass)[name]
            get = getattr(type(value), "__get__", None)
            return value if get is None else get(value, owner, type(owner))
    raise AttributeError(f"{type(owner).__name__!r} object has no attribute {name!r}")


# -------------------------------------------------------- holding batches


FUNCTIONS = ("train", "test", "predict")
# What fit() and evaluate() hand the train and test functions.
_TF_ITERATORS = (tf.data.Iterator, tf.distribute.DistributedIterator)


def hold_batches(
    model,
    extra_logs=None,
    before_call=None,
    after_call=None,
    function="train",
    is_current=None,
    teardown=None,
):
    """Wraps one of `model.train_function`, `model.test_function` or
    `model.predict_function` so the batches of the last call stay reachable,
    at no cost (the tensors exist anyway; nothing is copied).

    Keras' train and test functions take an iterator; given a list of
    batches they run their compiled one-step function on each. This wrapper
    draws up to `steps_per_execution` batches itself and runs that list path
    inside one `tf.function` traced for the iterator's `element_spec`, so the
    step is traced as Keras traces it (the batch dimension stays `None`: a
    short last batch is no retrace) and a chunk of `steps_per_execution`
    steps is still one call. Keras' predict function is called with the list
    of batches already drawn (`predict()` draws them); the wrapper passes it
    on.

    Wrappers stack (see `patch`): several callbacks may each hold the
    batches, and undo in any order.

    Args:
        model: a Keras model whose function is made (`make_train_function`,
            `make_test_function`, `make_predict_function`).
        extra_logs: optional callable returning a dict merged into the logs
            of every call (so the progress bar and History show it); ignored
            for `function="predict"`, whose result is the predictions (and
            note that extra keys in the test logs change what `evaluate()`
            returns). Defaults to `None`.
        before_call: optional callable `(batches)`, called before each call
            with the list of batches it will run (eager tensors: their shapes
            are concrete, and reading a shape costs no device sync).
            Defaults to `None`.
        after_call: optional callable `(batches, logs)` called after each
            call with its logs (tensors, not yet read; for predict, the
            outputs); a dict it returns is merged into the logs, as for
            `extra_logs`. Defaults to `None`.
        function: which function to wrap: `"train"`, `"test"` or
            `"predict"`. Defaults to `"train"`.
        is_current: optional callable `()` asked at each call from `fit()` or
            `evaluate()` (a call with a `tf.data` iterator); False means the
            owner of the wrapper is not part of that run (the run that put
            the wrapper in place ended in an exception, and Keras called no
            `on_*_end`): the wrapper then calls `teardown` and passes the
            call on. Defaults to `None`.
        teardown: optional callable `()` that removes the owner's wrappers
            (this one included), called when `is_current()` is False and when
            a call raises anything other than the end of the data. Defaults
            to `None`.

    Returns:
        `(held, undo)`: the list that holds the last call's batches, and a
        function that removes the wrapper.

    Raises:
        ValueError: for an unknown `function`, or one the model has not made.
    """
    attribute = _function_attribute(model, function)
    holder = _Holder(model, function, extra_logs, before_call, after_call, is_current, teardown)
    holder.undo = patch(
        model,
        attribute,
        holder,
        passthrough=lambda below, iterator: _run_chunk(model, below, iterator),
    )
    return holder.held, holder.undo


def _function_attribute(model, function):
    if function not in FUNCTIONS:
        raise ValueError(
            "Invalid value for argument `function`. Received: "
            f"function={function!r}. Expected one of "
            f"{', '.join(map(repr, FUNCTIONS))}."
        )
    attribute = f"{function}_function"
    if getattr(model, attribute, None) is None:
        raise ValueError(
            f"Invalid value for argument `function`. Received: "
            f"function={function!r}, but `model.{attribute}` is None. Call "
            f"`model.make_{function}_function()` first."
        )
    return attribute


class _Holder:
    """The `hold_batches` wrapper: `holder(original, iterator)`."""

    def __init__(self, model, function, extra_logs, before_call, after_call, is_current, teardown):
        self.model = model
        self.predict = function == "predict"
        self.extra_logs = extra_logs
        self.before_call = before_call
        self.after_call = after_call
        self.is_current = is_current
        self.teardown = teardown
        self.held = []
        self.undo = None  # the Patch, once installed

    def __call__(self, original, iterator):
        if (
            self.is_current is not None
            and isinstance(iterator, _TF_ITERATORS + (_Chunk,))
            and not self.is_current()
        ):
            (self.teardown or self.undo)()
            self.undo()  # in case `teardown` left it
            return _run_chunk(self.model, original, iterator)
        try:
            return self._call(original, iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            raise  # the end of the data: the run goes on
        except BaseException:
            if self.teardown is not None:
                self.teardown()  # Keras calls no on_*_end after an exception
            raise

    def _call(self, original, iterator):
        if self.predict:  # predict() hands over the list it drew
            batches = list(iterator)
        else:
            batches = draw_batches(self.model, iterator)
        if not batches:
            raise StopIteration
        self.held[:] = batches
        if self.before_call is not None:
            self.before_call(batches)
        logs = _run_chunk(self.model, original, batches)
        if self.after_call is not None:
            more = self.after_call(batches, logs)
            if more and not self.predict:
                logs = {**logs, **more}
        if self.extra_logs is not None and not self.predict:
            logs = {**logs, **self.extra_logs()}
        return logs


def draw_batches(model, iterator):
    """The batches one call of `model.train_function` (or `test_function`)
    would run: up to `steps_per_execution` batches drawn from `iterator`.

    Drawn from a `tf.data` iterator, the list keeps its `element_spec`, so
    `run_batches` runs them as one call traced for that spec. A list already
    drawn (by a `hold_batches` wrapper) is returned as it is.

    Args:
        model: the compiled model.
        iterator: what Keras passes to the function: a `tf.data` or
            distributed iterator, a drawn list, or any iterable of batches.

    Returns:
        A list of batches (empty when the iterator is exhausted).
    """
    if isinstance(iterator, _Chunk):  # drawn by a wrapper above this one
        return iterator
    if isinstance(iterator, _TF_ITERATORS):
        batches = _Chunk(iterator.element_spec)
        for _ in range(model.steps_per_execution):
            try:
                batches.append(next(iterator))
            except (StopIteration, tf.errors.OutOfRangeError):
                break
        return batches
    return list(itertools.islice(iterator, model.steps_per_execution))


def run_batches(model, function, batches):
    """Runs a train/test function (Keras' own, or a wrapper) on batches from
    `draw_batches`, as one call: the step is not traced again for the
    batches' concrete shapes, and a chunk of `steps_per_execution` batches
    is not split into separate calls.

    Returns:
        The logs of the call.
    """
    return _run_chunk(model, function, batches)


def runs_batches(function):
    """Marks `function` (a train function that dispatches to other ones) as
    taking a list of drawn batches itself: `hold_batches` wrappers above it
    call it with the list instead of tracing it into a `tf.function` (which
    would freeze its Python dispatch). It must then hand a list to
    `run_batches`. Returns `function`."""
    function._runs_batches = True
    return function


class _Chunk(list):
    """The batches one call runs, drawn from a `tf.data` iterator whose
    `element_spec` they keep (wrappers below the drawing one pass it on)."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec


def _run_chunk(model, function, batches):
    """Calls `function` (a wrapper, or Keras' function at the bottom) on
    `batches`. Keras' function is run in a `tf.function` traced once per
    chunk length for the drawn iterator's `element_spec`: called eagerly with
    the batches it would trace its step for their concrete shapes, then
    again for the short last batch, and would run a chunk of
    `steps_per_execution` steps as that many calls."""
    if (
        is_patched(function)
        or getattr(function, "_runs_batches", False)
        or not isinstance(batches, _Chunk)
        or model.run_eagerly
    ):
        return function(batches)
    runner = getattr(function, "_chunk_runner", None)
    if runner is None:  # kept on the function, so it goes when that goes
        runner = function._chunk_runner = _ChunkRunner(function)
    return runner(batches)


class _ChunkRunner:
    def __init__(self, function):
        self.traced = set()
        self.run = tf.function(function, autograph=False)

    def __call__(self, batches):
        key = (len(batches), tuple(tf.nest.flatten(batches.spec)))
        if key not in self.traced:
            # Traced for the spec, eager calls dispatch to it (a supertype).
            self.run.get_concrete_function([batches.spec] * len(batches))
            self.traced.add(key)
        return self.run(list(batches))


def base_function(model, function="train"):
    """The train/test/predict function under every `hold_batches` wrapper:
    the one Keras (or a callback) made; None when it is not made."""
    return base(model, f"{function}_function")


def base_train_function(model):
    """The train function under every `hold_batches` wrapper: the one Keras
    (or a callback) made."""
    return base_function(model, "train")


def replace_base_train_function(model, new):
    """Puts `new` in place of `base_train_function(model)`, under the
    `hold_batches` wrappers of other callbacks (which stay in place); see
    `replace_base`.

    Returns:
        A function that takes `new` away again.
    """
    return replace_base(model, "train_function", new)


def make_train_function_with_logs(model, extra_logs):
    """Makes a new train function whose step also returns `extra_logs()`.

    `extra_logs` is called inside the traced step (after the model's own
    `train_step`) and returns a dict of tensors, which the train function
    returns with the step's logs: the callback that reads them late reads a
    value the step already computed, with no extra op. Keras'
    `make_train_function` binds `model.train_step` when it makes the
    function: the wrapped step is in place only while it is made.
    `model.train_function` is left as it was.

    Returns:
        The new train function (not yet traced).
    """
    top = model.train_function
    undo = patch(
        model,
        "train_step",
        lambda step, data: {**step(data), **extra_logs()},
        keep_wrapping=True,
    )
    try:
        model.make_train_function(force=True)
        made = model.train_function
    finally:
        undo()
        # As it was, or as wrappers undone meanwhile left it (NaNWatcher's
        # `make_train_function` tears the watcher down).
        _set(model, "train_function", _settled(model, "train_function", top))
    return made
