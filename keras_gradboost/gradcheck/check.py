"""`gradcheck` and `assert_gradients_close`: every gradient of a function or
Keras layer against independent computations."""

import numpy as np
import tensorflow as tf

from keras_gradboost.callbacks import args
from keras_gradboost.gradcheck import numeric
from keras_gradboost.gradcheck.result import GradCheckResult
from keras_gradboost.gradcheck.result import SourceCheck
from keras_gradboost.gradcheck.target import Target
from keras_gradboost.gradcheck.target import as_vector

MODES = ("auto", "full", "fast")
# "auto" builds whole Jacobians up to this many entries (outputs x sources).
AUTO_FULL_ENTRIES = 1_000_000
# "full" refuses more entries than this (float64 Jacobians of 400 MB each).
MAX_FULL_ENTRIES = 50_000_000


def gradcheck(
    fn,
    *inputs,
    atol=None,
    rtol=None,
    mode="auto",
    probes=3,
    forward=True,
    jit=True,
    second_order=False,
    numeric_dtype="float64",
    step=None,
    seed=0,
):
    """Checks every gradient of `fn` at `inputs` against numeric differences.

    Beyond `tf.test.compute_gradient` (which returns two Jacobians and checks
    nothing), each gradient source (float input, and every trainable weight
    of a Keras layer or model) is checked for:

    * shape and dtype: a gradient must have exactly its source's shape and
      dtype. TensorFlow accepts a custom gradient of another shape silently
      (a scalar for a vector is broadcast), and the model trains "strangely";
      here it fails, naming the source and both shapes;
    * values: reverse mode against central differences computed in
      `numeric_dtype` (`fn` re-run in float64; a layer re-built in float64
      with the same weights), with steps chosen per dtype. `mode="full"`
      compares whole Jacobians element-wise; `mode="fast"` compares random
      probes `u^T J d` with one directional difference each, for sources too
      large for a Jacobian;
    * `None` versus zero: a `None` gradient (TensorFlow sees no path) is
      reported as such, and is wrong if the outputs depend on the source;
    * forward mode (`tf.autodiff.ForwardAccumulator`) against reverse mode;
    * `tf.function(jit_compile=True)` against eager;
    * on request, the gradient of the gradient.

    `fn` must be deterministic (a layer is called as `fn(*inputs)`, so
    Dropout is off). Integer inputs are passed as they are and not checked.

    Args:
        fn: a function of tensors returning a (nested) tensor output, or a
            Keras layer or model.
        *inputs: the positional arguments of `fn` (tensors, NumPy arrays,
            Python floats).
        atol: absolute tolerance, for every source. Defaults to `None`: by
            each source's dtype (float32: 1e-4, float64: 1e-6, float16:
            5e-3, bfloat16: 5e-2).
        rtol: relative tolerance. Defaults to `None`: by dtype (float32:
            1e-3, float64: 1e-5, float16: 1e-2, bfloat16: 5e-2).
        mode: `"full"`, `"fast"` or `"auto"` (full up to 10^6 Jacobian
            entries). Defaults to `"auto"`.
        probes: random probes per source for the fast, forward and second
            order checks. Defaults to `3`.
        forward: check forward mode against reverse mode. Defaults to `True`.
        jit: check the gradients under `jit_compile=True` against eager.
            Defaults to `True`.
        second_order: check the gradient of the gradient too. Defaults to
            `False`.
        numeric_dtype: `"float64"`, or `None` for differences in each
            source's own dtype (for a function that cannot run in float64).
            Defaults to `"float64"`.
        step: absolute step of the differences. Defaults to `None`:
            `cbrt(eps) * max(1, |x|)` of the numeric dtype.
        seed: seed of the random probes. Defaults to `0`.

    Returns:
        A `GradCheckResult`: `.ok`, one `SourceCheck` per source (max
        absolute and relative errors, the problems found), and a readable
        `str()`.

    Raises:
        ValueError: an invalid argument, nothing to differentiate, or a
            Jacobian too large for `mode="full"`.
        TypeError: an argument of the wrong type, or `fn` fails in float64.

    Example:

    ```python
    import tensorflow as tf
    import keras_gradboost as kgb

    @tf.custom_gradient
    def log1pexp(x):
        def grad(upstream):
            return upstream * tf.sigmoid(x)
        return tf.math.softplus(x), grad

    result = kgb.gradcheck(log1pexp, tf.constant([-3.0, 0.0, 2.0]), jit=False)
    assert result.ok, result
    print(result)
    ```
    """
    atol, rtol = _tolerance("atol", atol), _tolerance("rtol", rtol)
    mode = args.check_choice("mode", mode, MODES)
    probes = args.check_int("probes", probes, 1)
    for name, value in (("forward", forward), ("jit", jit), ("second_order", second_order)):
        args.check_bool(name, value)
    if numeric_dtype is not None and numeric_dtype != "float64":
        raise args.value_error("numeric_dtype", numeric_dtype, '"float64" or None')
    if step is not None:
        step = args.check_number("step", step, above=0.0)
    seed = args.check_int("seed", seed, 0)

    target = Target(fn, inputs, numeric_dtype)
    sizes = [int(np.prod(v.shape)) for v in target.values]
    entries = target.m * sum(sizes)
    if mode == "auto":
        mode = "full" if entries <= AUTO_FULL_ENTRIES else "fast"
    elif mode == "full" and entries > MAX_FULL_ENTRIES:
        raise ValueError(
            f"Invalid value for argument `mode`. Received: mode='full' for a "
            f"Jacobian of {target.m} outputs x {sum(sizes)} source elements "
            f"({entries} entries, more than {MAX_FULL_ENTRIES}). Expected "
            "mode='fast' (random probes) or smaller inputs."
        )
    return _Checker(target, atol, rtol, mode, probes, step, seed).run(
        forward, jit, second_order
    )


def _tolerance(name, value):
    """None, or a real number >= 0, as a float."""
    if value is None:
        return None
    if not isinstance(value, (int, float, np.floating)) or isinstance(value, bool):
        raise args.type_error(name, value, "a float >= 0 or None")
    if not value >= 0:
        raise args.value_error(name, value, "a float >= 0 or None")
    return float(value)


def assert_gradients_close(fn, *inputs, **kwargs):
    """`gradcheck(fn, *inputs, **kwargs)`, raising `AssertionError` with its
    report when a check fails (for tests).

    Args:
        fn: as for `gradcheck`.
        *inputs: as for `gradcheck`.
        **kwargs: `gradcheck`'s keyword arguments.

    Returns:
        The `GradCheckResult`, when it is ok.

    Raises:
        AssertionError: a check failed; the message is `str(result)`.

    Example:

    ```python
    import tensorflow as tf
    import keras_gradboost as kgb

    kgb.assert_gradients_close(kgb.ops.safe_sqrt, tf.constant([0.5, 4.0]), jit=False)
    ```
    """
    result = gradcheck(fn, *inputs, **kwargs)
    if not result.ok:
        raise AssertionError(str(result))
    return result


class _Checker:
    """One run of the checks over a `Target`'s sources."""

    def __init__(self, target, atol, rtol, mode, probes, step, seed):
        self.target, self.mode, self.probes, self.step = target, mode, probes, step
        self.atol, self.rtol = atol, rtol
        self.rng = np.random.default_rng(seed)
        self.values64 = target.numeric_values()
        self.notes = []
        self.found = [dict(problems=[]) for _ in target.values]

    # ---------------------------------------------------------------- helpers

    def tol(self, i):
        atol, rtol = numeric.tolerances(self.target.source_dtype(i))
        return (atol if self.atol is None else self.atol,
                rtol if self.rtol is None else self.rtol)

    def random_outputs(self):
        return [self.rng.standard_normal(s) for s, _ in self.target.output_specs]

    def random_like(self, i):
        return self.rng.standard_normal(tuple(self.target.values[i].shape))

    def kind(self, i):
        return "input" if i < self.target.n_inputs else "weight"

    def problem(self, i, text):
        self.found[i]["problems"].append(f"{self.target.names[i]}: {text}")

    def dense(self, grads):
        """float64 flat vectors of the gradients of the good sources (zeros
        for None)."""
        out = []
        for i, g in enumerate(grads):
            if i not in self.good:
                out.append(None)
            elif g is None:
                out.append(np.zeros(int(np.prod(self.target.values[i].shape))))
            else:
                out.append(np.reshape(tf.cast(tf.convert_to_tensor(g), tf.float64).numpy(), [-1]))
        return out

    # ----------------------------------------------------------------- checks

    def run(self, forward, jit, second_order):
        u0 = self.random_outputs()
        grads = self.target.vjp([tf.constant(u) for u in u0])
        self.good = set(self.check_structure(grads))
        first = self.dense(grads)
        if self.mode == "full":
            self.check_full()
        probe_list = self.check_probes(u0, first)
        if forward:
            self.check_forward(probe_list)
        if jit:
            self.check_jit(u0, first)
        if second_order:
            self.check_second_order()
        sources = []
        for i, value in enumerate(self.target.values):
            found = self.found[i]
            sources.append(SourceCheck(
                name=self.target.names[i],
                shape=tuple(value.shape),
                dtype=value.dtype.name,
                gradient=found.get("gradient", "tensor"),
                max_abs_error=found.get("abs"),
                max_rel_error=found.get("rel"),
                forward_error=found.get("forward"),
                jit_error=found.get("jit"),
                second_order_error=found.get("second"),
                problems=tuple(found["problems"]),
            ))
        return GradCheckResult(
            sources=tuple(sources),
            mode=self.mode,
            numeric_dtype=self.target.numeric_dtype or "the sources' own dtypes",
            atol=self.atol,
            rtol=self.rtol if self.atol is not None else None,
            notes=tuple(self.notes),
        )

    def check_structure(self, grads):
        """Shape, dtype, None and IndexedSlices; yields the sources whose
        gradient can be compared."""
        for i, (g, value) in enumerate(zip(grads, self.target.values)):
            kind, shape = self.kind(i), tuple(value.shape)
            if g is None:
                self.found[i]["gradient"] = "None"
                yield i
                continue
            if isinstance(g, tf.IndexedSlices):
                self.found[i]["gradient"] = "IndexedSlices"
                g = tf.convert_to_tensor(g)
            received = tuple(g.shape)
            if received != shape:
                self.found[i]["gradient"] = f"shape {received}"
                self.problem(
                    i,
                    f"the gradient has the wrong shape: expected {shape} (the "
                    f"{kind}'s shape), received {received}. TensorFlow accepts "
                    "such a gradient silently (it is broadcast or summed "
                    "further up) and the model trains on wrong values. "
                    f"Return a gradient of shape {shape}.",
                )
                continue
            if g.dtype != value.dtype:
                self.found[i]["gradient"] = f"dtype {g.dtype.name}"
                self.problem(
                    i,
                    f"the gradient has the wrong dtype: expected "
                    f"{value.dtype.name} (the {kind}'s dtype), received "
                    f"{g.dtype.name}.",
                )
                continue
            if not bool(tf.reduce_any(tf.cast(g, tf.float64) != 0)):
                self.found[i]["gradient"] = "zero"
            yield i

    def _rows(self):
        """The reverse-mode Jacobian of the good sources, one vjp per output
        element (float64, m x size per source)."""
        m = self.target.m
        specs = self.target.output_specs

        def vjp_of(k):
            flat = tf.one_hot(k, m, dtype=tf.float64)
            parts, start = [], 0
            for shape, _ in specs:
                size = int(np.prod(shape))
                parts.append(tf.reshape(flat[start : start + size], shape))
                start += size
            grads = self.target.vjp(parts)
            return [
                as_vector([tf.convert_to_tensor(g)]) if g is not None and i in self.good
                else tf.zeros([int(np.prod(self.target.values[i].shape))], tf.float64)
                for i, g in enumerate(grads)
            ]

        try:
            traced = tf.function(vjp_of)
            rows = [traced(tf.constant(k)) for k in range(m)]
        except (TypeError, ValueError, NotImplementedError,
                tf.errors.OperatorNotAllowedInGraphError):
            rows = [vjp_of(k) for k in range(m)]
        return [np.stack([r[i].numpy() for r in rows]) for i in range(len(self.target.values))]

    def check_full(self):
        rows = self._rows()
        for i in sorted(self.good):
            num = numeric.columns(self.target.outputs64, self.values64, i, self.step).numpy()
            self.compare(i, rows[i], num, "Jacobian entry")

    def compare(self, i, analytic, num, where):
        atol, rtol = self.tol(i)
        abs_err, rel_err, ok = numeric.close(analytic, num, atol, rtol)
        self.found[i]["abs"], self.found[i]["rel"] = abs_err, rel_err
        if ok:
            return
        if self.found[i].get("gradient") == "None":
            self.problem(
                i,
                "the gradient is None (TensorFlow sees no path from it to the "
                "outputs), but the outputs depend on it: the numeric gradient "
                f"reaches {float(np.max(np.abs(num))):.3g}. Something cuts the "
                "path (tf.stop_gradient, a non-differentiable op, a NumPy "
                "round trip).",
            )
            return
        diff = np.abs(np.asarray(analytic) - np.asarray(num))
        diff = np.where(np.isnan(diff), np.inf, diff)
        worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
        at = f" at {where} (output {worst[0]}, element {worst[1]})" if len(worst) == 2 else ""
        self.problem(
            i,
            f"the reverse-mode gradient differs from the numeric one: max abs "
            f"error {abs_err:.3g} (rel {rel_err:.3g}), beyond atol={atol:g} + "
            f"rtol={rtol:g} * |numeric|{at}: analytic "
            f"{float(np.asarray(analytic)[worst]):.6g}, numeric "
            f"{float(np.asarray(num)[worst]):.6g}.",
        )

    def check_probes(self, u0, first):
        """Random probes `(i, u, d, reverse u^T J d, numeric J d)` for each
        good source; in fast mode, compared here."""
        found = []
        for p in range(self.probes):
            u = u0 if p == 0 else self.random_outputs()
            dense = first if p == 0 else self.dense(
                self.target.vjp([tf.constant(a) for a in u]))
            u_vec = np.concatenate([np.reshape(a, [-1]) for a in u])
            for i in sorted(self.good):
                d = self.random_like(i)
                w = numeric.directional(
                    self.target.outputs64, self.values64, i, d, self.step).numpy()
                found.append((i, u, d, float(dense[i] @ np.reshape(d, [-1])), w))
                if self.mode == "fast":
                    self.compare_probe(i, d, found[-1][3], float(u_vec @ w), w)
        return found

    def compare_probe(self, i, d, a, n, w):
        atol, rtol = self.tol(i)
        abs_err, rel_err, ok = numeric.probe_close(
            a, n, np.linalg.norm(d), np.linalg.norm(w), atol, rtol)
        f = self.found[i]
        f["abs"], f["rel"] = max(f.get("abs") or 0.0, abs_err), max(f.get("rel") or 0.0, rel_err)
        if ok or f.get("probe_failed"):
            return
        f["probe_failed"] = True
        if f.get("gradient") == "None":
            self.problem(
                i,
                "the gradient is None (TensorFlow sees no path from it to the "
                "outputs), but the outputs depend on it: a directional "
                f"difference gives u^T J d = {n:.3g}.",
            )
            return
        self.problem(
            i,
            f"the reverse-mode gradient differs from the numeric one along a "
            f"random probe: u^T J d = {a:.6g} (reverse) vs {n:.6g} (numeric), "
            f"error {abs_err:.3g}, rel {rel_err:.3g} to |J d|, beyond "
            f"atol={atol:g}, rtol={rtol:g}.",
        )

    def check_forward(self, probe_list):
        skipped = set()
        for i, u, d, a, w in probe_list:
            if i in skipped:
                continue
            try:
                jv = self.target.jvp(i, tf.constant(d)).numpy()
            except Exception as error:  # an op without forward mode, etc.
                skipped.add(i)
                self.notes.append(
                    f"forward mode of {self.target.names[i]} skipped: "
                    f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                )
                continue
            u_vec = np.concatenate([np.reshape(x, [-1]) for x in u])
            atol, rtol = self.tol(i)
            f_val = float(u_vec @ jv)
            _, rel, ok = numeric.probe_close(
                f_val, a, np.linalg.norm(d),
                max(np.linalg.norm(w), np.linalg.norm(jv)), atol, rtol)
            found = self.found[i]
            found["forward"] = max(found.get("forward") or 0.0, rel)
            if not ok and not found.get("forward_failed"):
                found["forward_failed"] = True
                self.problem(
                    i,
                    f"forward mode disagrees with reverse mode: u^T jvp(d) = "
                    f"{f_val:.6g}, vjp(u) . d = {a:.6g} (rel {rel:.3g}).",
                )

    def check_jit(self, u0, first):
        u = [tf.constant(a) for a in u0]

        def grads():
            return [
                tf.zeros([0], tf.float64) if g is None else as_vector([tf.convert_to_tensor(g)])
                for g in self.target.vjp(u)
            ]

        try:
            compiled = [g.numpy() for g in tf.function(grads, jit_compile=True)()]
        except Exception as error:  # XLA cannot compile an op, etc.
            self.notes.append(
                "jit_compile=True skipped: XLA could not compile the gradient "
                f"({type(error).__name__}: {str(error).splitlines()[0][:200]})"
            )
            return
        for i in sorted(self.good):
            eager = first[i]
            jitted = compiled[i] if compiled[i].size else np.zeros_like(eager)
            if jitted.shape != eager.shape:
                self.problem(
                    i, f"under jit_compile=True the gradient has {jitted.size} "
                    f"elements, eager {eager.size}.")
                continue
            atol, rtol = self.tol(i)
            _, rel, ok = numeric.close(jitted, eager, atol, rtol)
            self.found[i]["jit"] = rel
            if not ok:
                self.problem(
                    i,
                    "the gradient under jit_compile=True differs from eager: "
                    f"rel error {rel:.3g}, beyond atol={atol:g}, rtol={rtol:g}.",
                )

    def check_second_order(self):
        """The gradient of `r . vjp(u)` against central differences of the
        numeric-dtype `vjp(u)` (computed by autodiff in that dtype)."""
        target = self.target
        u = self.random_outputs()
        r = [self.random_like(j) for j in range(len(target.values))]
        r_vec = np.concatenate([np.reshape(x, [-1]) for x in r])
        n_in = target.n_inputs

        def grads64(values):
            values = [tf.identity(v) for v in values]
            with tf.GradientTape() as tape:
                tape.watch(values)
                y = target.outputs64(values)
            u64 = tf.cast(as_vector([tf.constant(a) for a in u]), y.dtype)
            g = tape.gradient(y, values, output_gradients=u64,
                              unconnected_gradients="zero")
            return as_vector(g)

        xs = [tf.identity(x) for x in target.values[:n_in]]
        with tf.GradientTape() as outer:
            outer.watch(xs)
            first = target.vjp([tf.constant(a) for a in u], xs)
            s = tf.add_n([
                tf.reduce_sum(tf.cast(tf.convert_to_tensor(g), tf.float64) * r[j])
                for j, g in enumerate(first) if g is not None and j in self.good
            ] or [tf.constant(0.0, tf.float64)])
        hessian = outer.gradient(s, xs + target.weights, unconnected_gradients="zero")
        for i in sorted(self.good):
            d = self.random_like(i)
            a = float(tf.reduce_sum(tf.cast(tf.convert_to_tensor(hessian[i]), tf.float64) * d))
            w = numeric.directional(grads64, self.values64, i, d, self.step).numpy()
            atol, rtol = self.tol(i)
            _, rel, ok = numeric.probe_close(
                a, float(r_vec @ w), np.linalg.norm(d), np.linalg.norm(w), atol, rtol)
            self.found[i]["second"] = rel
            if not ok:
                self.problem(
                    i,
                    f"the second-order gradient differs from the numeric one: "
                    f"r . H d = {a:.6g} (autodiff) vs {float(r_vec @ w):.6g} "
                    f"(differences), rel {rel:.3g}.",
                )
