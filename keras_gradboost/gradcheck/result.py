"""What `gradcheck` found: one `SourceCheck` per gradient source (float
input or trainable weight), gathered in a `GradCheckResult`."""

import dataclasses


def _err(value):
    return "-" if value is None else f"{value:.2e}"


@dataclasses.dataclass(frozen=True)
class SourceCheck:
    """The checks of one gradient source.

    Attributes:
        name: e.g. `"input 'x'"`, `"input 1"` or `"weight 'dense/kernel'"`.
        shape: the source's shape.
        dtype: the source's dtype name.
        gradient: what reverse mode returned: `"tensor"`, `"None"` (TensorFlow
            sees no path from the source to the outputs), `"IndexedSlices"`,
            or `"shape (…)"`/`"dtype …"` when it has the wrong one.
        max_abs_error: largest `|analytic - numeric|` of the reverse-mode
            gradient (full mode: element-wise over the Jacobian; fast mode:
            over the random probes `u^T J d`). None if not compared.
        max_rel_error: that error relative to the largest numeric entry
            (fast mode: to `|J d|`).
        forward_error: relative error of forward mode against reverse mode
            (`u^T jvp(d)` against `vjp(u) . d`), or None.
        jit_error: relative error of the gradient under
            `tf.function(jit_compile=True)` against eager, or None.
        second_order_error: relative error of the gradient of the gradient
            (probes) against differences of the numeric-dtype gradient, or
            None.
        problems: sentences, one per failed check; empty when all passed.
    """

    name: str
    shape: tuple
    dtype: str
    gradient: str = "tensor"
    max_abs_error: object = None
    max_rel_error: object = None
    forward_error: object = None
    jit_error: object = None
    second_order_error: object = None
    problems: tuple = ()

    @property
    def ok(self):
        return not self.problems


@dataclasses.dataclass(frozen=True)
class GradCheckResult:
    """What `kgb.gradcheck` found; `str(result)` is a readable report.

    Attributes:
        sources: one `SourceCheck` per float input, then per trainable weight.
        mode: `"full"` (whole Jacobians) or `"fast"` (random probes).
        numeric_dtype: the dtype of the numeric differences.
        atol: the absolute tolerance used (None: per source dtype).
        rtol: the relative tolerance used (None: per source dtype).
        notes: checks that were skipped, and why.
    """

    sources: tuple
    mode: str
    numeric_dtype: str
    atol: object = None
    rtol: object = None
    notes: tuple = ()

    @property
    def ok(self):
        """True when every check of every source passed."""
        return all(s.ok for s in self.sources)

    @property
    def problems(self):
        return tuple(p for s in self.sources for p in s.problems)

    def __getitem__(self, name):
        """The `SourceCheck` whose name is, or quotes, `name` (`result["x"]`,
        `result["dense/kernel"]`, `result["input 0"]`)."""
        for s in self.sources:
            if name in (s.name, s.name.split(" ", 1)[1].strip("'")):
                return s
        raise KeyError(
            f"No gradient source {name!r}. The sources are: "
            + ", ".join(s.name for s in self.sources)
        )

    def __str__(self):
        failed = sum(not s.ok for s in self.sources)
        verdict = "ok" if not failed else f"FAILED ({failed} of {len(self.sources)} sources)"
        tol = "per dtype" if self.atol is None else f"atol={self.atol:g}, rtol={self.rtol:g}"
        lines = [
            f"gradcheck: {verdict}; mode={self.mode}, numeric differences in "
            f"{self.numeric_dtype}, tolerances {tol}."
        ]
        header = ("source", "shape", "dtype", "gradient", "abs err", "rel err",
                  "forward", "jit", "2nd order")
        rows = [header] + [
            (s.name, str(s.shape), s.dtype, s.gradient, _err(s.max_abs_error),
             _err(s.max_rel_error), _err(s.forward_error), _err(s.jit_error),
             _err(s.second_order_error))
            for s in self.sources
        ]
        widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
        for row in rows:
            lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
        if failed:
            lines.append("problems:")
            lines.extend(f"  {p}" for p in self.problems)
        if self.notes:
            lines.append("notes:")
            lines.extend(f"  {n}" for n in self.notes)
        return "\n".join(lines)
