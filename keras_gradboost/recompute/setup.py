"""The per-model recompute setup: a model's `recompute` setting turned into
blocks, the training forward that recomputes them, and when each decision is
made.

Its lifecycle, each step one method the model calls:

* `compile()`: `RecomputeSetup(model, setting)` chooses the blocks (unless the
  setting is a budget) and `apply()` marks them;
* `fit()`: `before_fit(fit_args)` takes the batch size a budget and "auto"
  choose at from `fit`'s arguments (a generator's first batch, which it then
  yields again);
* the first traced training batch: `prepare(model, x)` chooses a budget's
  blocks, or records the input specs the estimates need;
* `recompute_check=True`: `check(model, batch)` compares the gradients on the
  first batch.
"""

import contextlib
import copy
import dataclasses
import types
import warnings

import keras
import tensorflow as tf

from keras_gradboost import depthwise
from keras_gradboost import hooks
from keras_gradboost import pointwise
from keras_gradboost.recompute import mechanism
from keras_gradboost.recompute import selective as selective_lib
from keras_gradboost.recompute.check import check as check_gradients
from keras_gradboost.recompute.budget import auto_choice
from keras_gradboost.recompute.budget import budget_choice
from keras_gradboost.recompute.budget import candidates
from keras_gradboost.recompute.budget import estimated_peak
from keras_gradboost.recompute.budget import groups_of
from keras_gradboost.recompute.budget import merge
from keras_gradboost.recompute.budget import peaks_without_buffers
from keras_gradboost.recompute.choice import RETYPED_NOTE
from keras_gradboost.recompute.choice import choose
from keras_gradboost.recompute.choice import graph_of
from keras_gradboost.recompute.choice import graphs_retyped
from keras_gradboost.recompute.choice import nested_names
from keras_gradboost.recompute.choice import search_families
from keras_gradboost.recompute.choice import resegment
from keras_gradboost.recompute.choice import retyped
from keras_gradboost.recompute.choice import segment_layouts
from keras_gradboost.recompute.choice import selective_blocks
from keras_gradboost.recompute.estimates import MIB
from keras_gradboost.recompute.estimates import BlockEstimate
from keras_gradboost.recompute.estimates import RecomputePlan
from keras_gradboost.recompute.estimates import eigen_convolution_kernels
from keras_gradboost.recompute.estimates import estimate
from keras_gradboost.recompute.estimates import estimate_together
from keras_gradboost.recompute.estimates import kept_bytes
from keras_gradboost.recompute.estimates import onednn_would_take
from keras_gradboost.recompute.estimates import plan_bytes
from keras_gradboost.recompute.estimates import selective_plan_bytes
from keras_gradboost.recompute.estimates import tied_inner_blocks
from keras_gradboost.recompute.estimates import variable_bytes
from keras_gradboost.recompute.estimates import with_pile_up
from keras_gradboost.recompute.estimates import without_working_buffers
from keras_gradboost.recompute.updates import step_gradients_pile_up
from keras_gradboost.recompute.updates import update_temporary_counts

# "auto" recomputes only where its best plan is estimated to save at least
# this share of the activation memory: the estimates leave out the
# recompute's own temporaries, and a plan estimated to save a few percent
# measured more memory than none (the keras.io text Transformer: 1.06x).
MIN_AUTO_SAVING = 0.1

# "auto" takes the cheapest plan to recompute whose estimated training peak
# is at most this share of the activation memory (without recompute) above
# the lowest estimate. The estimates hold the requested bytes within about
# 15% (benchmarks/RESULTS.md), for "auto"'s plans (about half the
# activations) 7-8% of the activations: plans closer than that cannot be
# told apart, and the lowest paid for it in step time. A keras-hub GPT-2
# backbone of 2 layers (width 256, sequences of 128, batch 16): the lowest,
# 61.6 MiB (no recompute: 155.1), took 8.46 GFLOP of recompute a step
# (1.42x the step time); 8% of its 147.1 MiB of activations above it,
# 69.6 MiB at 6.27 GFLOP (1.24x).
AUTO_SLACK = 0.08


def _has_forward(model):
    """Whether `model` has a `call` to estimate (one with its own
    `train_step`, a GAN's, may have none)."""
    return type(model).call is not keras.Model.call


def _unsplit(blocks, total, cut=(), retyped=False):
    """Why no plan saves, when one block of the finest layout holds most of
    the activations: nothing inside it can be cut (a sentence; "" else, and
    when it is among `cut`, the names of the functional layers whose graphs
    the search cut), and with `retyped` (`choice.retyped`) why not."""
    if not blocks or not total:
        return ""
    largest = max(blocks, key=lambda b: b.cached_bytes)
    if largest.cached_bytes < 0.5 * total or largest.name in cut:
        return ""
    return (
        f" One block, {largest.name!r}, holds ~{largest.cached_bytes / MIB:.1f} "
        f"of the ~{total / MIB:.1f} MiB, and nothing inside it is a block or a "
        "point where one tensor carries everything (a second tensor crosses "
        "every point: a Keras mask carried beside the activations, from "
        "`mask_zero=True` or `Masking`, or cells that each read the two before "
        "them, as NASNet's do): recomputing it whole "
        "replays all of it at once in its backward, so the peak stays about "
        "the same." + (RETYPED_NOTE if retyped else "")
    )


class RecomputeSetup:
    """A model's `recompute` setting turned into blocks, and the training
    forward that recomputes them.

    Args:
        model: the GradBoostModel.
        setting: the normalised `recompute` compile argument (not None).

    Raises:
        ValueError: a pattern matches nothing, or "auto" finds no block.
    """

    def __init__(self, model, setting):
        self.setting = setting
        self.selective = isinstance(setting, dict) and setting.get("policy") == "selective"
        self.budget = isinstance(setting, dict) and "budget_mb" in setting
        self.auto = setting == "auto"
        self.batch_hint = setting.get("batch_size") if self.budget else None
        self.input_spec = None  # per-example specs, seen at the first trace
        self.measured = None  # (peak bytes, batch size, slot bytes made, replicas) of the last fit
        self.fit_pile_up = _NOT_FITTED
        self._updates = None  # (optimizer, its update_temporaries, and alone)
        self._level = None
        # (chose the plan, optimizer variables before, replicas) of the fit
        # being measured: `_warn_if_over_budget`.
        self._fit_facts = None
        # `(signature, choice)`: the choice made under each dtype signature
        # of the layers (cut points depend on it: `_settle`).
        self._choices = []
        # layers, segments, chosen (keys: id(layer), or segment index), plan
        # (the RecomputePlan made for a budget or "auto"), pending.
        self._take(self._choice(model))
        # The signature the choice was made under (a budget: none yet).
        self._signature = None if self.budget else _dtype_signature(model)
        self.forwarded = False  # whether `forward` ran (in a model's own step)
        self.chained = False  # whether a holder's chain ran (likewise)

    @property
    def keys(self):
        if self.segments:
            return list(range(len(self.segments)))
        return [id(layer) for layer in self.layers]

    @property
    def holder(self):
        """The layer whose call runs the graph the segments cut (None: the
        model's own graph, or no segments)."""
        return self.segments[0].holder if self.segments else None

    def names(self):
        if self.segments:
            return {i: s.name for i, s in enumerate(self.segments)}
        return nested_names(self.layers)

    def _choice(self, model):
        """The choice that needs no batch, under the layers' dtype policies
        now, as attribute values (`_KEPT`): named blocks, a selective plan's,
        "auto"'s default (kept when the batches have no fixed size); a
        budget and "auto" choose again at the first traced batch
        (`pending`). Changes nothing (it may raise)."""
        layers, segments = [], []
        if self.selective:
            layers, segments = selective_blocks(model, self.setting["blocks"])
        elif not self.budget:
            layers, segments = choose(model, self.setting)
        chosen = set()
        if not self.budget:
            keys = range(len(segments)) if segments else [id(layer) for layer in layers]
            chosen = set(keys) - {i for i, s in enumerate(segments) if s.last}
        if self.selective and self.setting["blocks"] == "auto" and len(layers) > 1:
            # The last block's replay would come first in the backward, while
            # everything else is kept: the same peak without it.
            chosen.discard(id(layers[-1]))
        values = (layers, segments, chosen, None, self.budget or self.auto)
        return dict(zip(_KEPT, values))

    def _settle(self, model):
        """Makes the choice the one for the layers' dtype policies now.

        A graph's cut points depend on them (`choice.cut_points` leaves out
        a cut before a raw operation once a mixed policy retypes the graph),
        and they change after this setup first chose, at compile:
        `compile(precision=...)` sets its policy after, and
        `precision="auto"` switches between its candidates, each traced
        under its own. The choice made under each is kept, so a candidate
        traced again (or reported) finds its own. Layers built since (a
        subclassed model's nested `Sequential`s, at its first call) change
        nothing. Named blocks do not depend on it. Raises as `_choice` does,
        changing nothing.
        """
        if not (self.auto or self.budget or self.selective):
            return
        signature = _dtype_signature(model)
        if self._signature is None:  # a budget, which chooses from here
            self._signature = signature
        if _same_policies(signature, self._signature):
            self._signature = signature
            return
        cached = next((c for sig, c in self._choices if _same_policies(sig, signature)), None)
        state = cached if cached is not None else self._choice(model)
        self._choices = [
            (sig, c) for sig, c in self._choices if not _same_policies(sig, self._signature)
        ] + [(self._signature, {k: getattr(self, k) for k in _KEPT})]
        self._take(state)
        if cached is None:
            self.apply()
        self._signature = signature

    def _take(self, choice):
        """Sets the attributes of a choice (`_KEPT`, from `_choice`)."""
        for k, v in choice.items():
            setattr(self, k, v)

    # -------------------------------------------------------------- lifecycle

    def apply(self):
        """Marks the candidate layers, so a plan can recompute them (and,
        for a selective plan, the kernel layers inside them, whose outputs
        it keeps)."""
        for layer in self.layers + [self.holder] * (self.holder is not None):
            mechanism.mark(layer)
        if self.selective:
            parts = self.layers or [l for s in self.segments for l in s.layers]
            for layer in selective_lib.kernel_layers(parts):
                mechanism.mark(layer)

    def before_fit(self, fit_args, replicas=1):
        """Takes the batch size "auto" and a budget choose at from `fit`'s
        arguments, when neither the setting nor an earlier `fit` gave one
        and the blocks are not yet chosen: the traced batch may have no
        fixed size (`Dataset.batch` without `drop_remainder`, arrays whose
        length the batch size does not divide, a generator, a `PyDataset`),
        and "auto" then took the blocks found at compile (MobileNetV2 at
        64x64, batch 16: 11 coarse segments estimated at 37.0 MiB, where the
        batch size gives 13 at 29.5).

        Args:
            fit_args: `fit`'s arguments as a dict. A generator `x` is
                replaced by one that yields the first batch, read here, again
                (as Keras' own adapter does to read the batches' specs).
            replicas: the distribution strategy's replicas in sync: each
                traces its share of the batch. Defaults to `1`.
        """
        if (self.budget or self.auto) and self.pending and self.batch_hint is None:
            batch = batch_size_hint(fit_args)
            self.batch_hint = -(-batch // replicas) if batch else batch

    def prepare(self, model, x):
        """Settles what the training forward needs from the first traced
        batch `x`: a budget's choice, or else the input specs. Call it
        outside any tape, before `forward`."""
        self._settle(model)
        if self.pending:
            self.resolve(model, x)
        elif self.input_spec is None:
            self.observe(x)

    def check(self, model, batch):
        """`recompute_check=True`: settles a budget's choice on `batch` and
        compares the gradients with and without each block recomputed (and
        each block holding chosen blocks, with them nested).

        Raises:
            RecomputeCheckError: naming the first block that changes a
                gradient.
        """
        self._settle(model)
        if self.pending:
            x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
            self.resolve(model, x)
        check_gradients(model, self, batch)

    def start_measuring(self, model=None):
        """Resets the device allocator's peak at the start of `fit` (when
        the device's allocator keeps statistics: a GPU; a CPU with
        `TF_CPU_ALLOCATOR_USE_BFC=true`, or by default on some). With
        `model`, notes what a budget's check after the fit needs: whether
        this fit chooses the plan (so runs at its batch size), the
        optimizer's variables before it, and the replicas."""
        self._level = _memory_level()
        optimizer = getattr(model, "optimizer", None)
        self._fit_facts = (
            self.pending,
            # (Its step counter and learning rate exist before it is built.)
            {id(v) for v in optimizer.variables} if optimizer is not None else set(),
            model.distribute_strategy.num_replicas_in_sync if model is not None else 1,
        )

    def stop_measuring(self, model=None):
        """Reads the allocator's peak at the end of `fit`: the measured
        figure `recompute_plan()` shows beside its estimate."""
        if self._level is None:
            return
        device, before = self._level
        self._level = None
        try:
            peak = tf.config.experimental.get_memory_info(device)["peak"]
        except (ValueError, RuntimeError):
            return
        if peak > 0:  # 0: an allocator that keeps no statistics
            replicas = _replicas_sharing(model, device)
            # Each replica holds a copy of a mirrored variable (one copy
            # under a CentralStorageStrategy).
            mirrored = isinstance(
                getattr(model, "distribute_strategy", None), tf.distribute.MirroredStrategy
            )
            slots = (replicas if mirrored else 1) * self._slots_made(model)
            self.measured = (peak - before, self.batch_hint, slots, replicas)
            self._warn_if_over_budget(model, peak - before, slots)

    def _slots_made(self, model):
        """Bytes of the optimizer variables (Adam's moments...) that the fit
        measured (`start_measuring`) created: in its peak, in no estimate."""
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None or self._fit_facts is None:
            return 0
        before = self._fit_facts[1]
        return sum(variable_bytes(v) for v in optimizer.variables if id(v) not in before)

    def _warn_if_over_budget(self, model, measured, slots):
        """A budget is met by the estimates (within ~15% of the bytes
        requested), and the allocator reserves whole chunks: a fit can
        measure over the budget the plan was estimated under. Said, with
        the figures, rather than left for `recompute_plan()` to show. Only
        for the fit that chose the plan (at its batch size), on one replica
        (logical devices share one allocator), and without the optimizer's
        slots the fit made (a budget counts none)."""
        if not self.budget or self._fit_facts is None:
            return
        chose, _, replicas = self._fit_facts
        if not chose or replicas != 1 or measured - slots <= self.setting["budget_mb"] * MIB:
            return
        estimate = (
            f", the plan estimated at ~{self.plan.peak_bytes / MIB:.1f} MiB"
            if self.plan is not None and self.plan.peak_bytes
            else ""
        )
        made = f" ({(measured - slots) / MIB:.1f} MiB without the optimizer's slots it made)"
        warnings.warn(
            f"recompute={self.setting!r}: the last fit's allocator peak was "
            f"{measured / MIB:.1f} MiB above the level before it"
            + (made if slots else "")
            + f", over the budget of {self.setting['budget_mb']:g} MiB{estimate} (the "
            "estimates hold the bytes requested within ~15%, and the "
            "allocator reserves whole chunks). Lower budget_mb by the "
            "difference, or the batch size (with accumulate_steps to keep "
            "the effective batch).",
            stacklevel=4,
        )

    # ---------------------------------------------------------------- forward

    @contextlib.contextmanager
    def around_own_step(self, model, data):
        """The context of a model's own `train_step` on `data`: the chosen
        blocks it calls recompute, as in `forward`.

        "auto" and a budget choose at the first batch, as the plan reported
        before `fit` does: from the model's input specs where it has them
        (a functional model), at the batch size of `data`'s first tensor;
        nothing else is inferred from `data`, which need not be the model's
        input. Without them "auto" keeps the blocks found at compile, and a
        budget waits for GradBoostModel's forward (`super().train_step`).

        A plan of segments of the model's own graph is run by `forward`
        alone: when the step made no call of it (its forward is its own),
        raises a `ValueError` as the step's trace ends, before anything
        trains. Segments of a layer's graph run inside that layer's calls,
        whoever makes them; likewise a `ValueError` when the step made
        none.
        """
        name = type(model).__name__
        self._settle(model)
        if self.pending and hooks.is_functional(model):
            first = next(iter(tf.nest.flatten(data)), None)
            shape = tf.TensorShape(getattr(first, "shape", None))  # numpy's too
            # The Input's specs at that batch size; None where a size is unknown
            # (then the batches' own shapes, if `super().train_step` runs).
            spec = self._spec(model, (shape[0] if shape.rank else None) or self.batch_hint)
            if spec is not None:
                self.resolve(model, spec)
        self.forwarded = self.chained = False
        with self._calls(self.chosen):
            yield
        if self.pending:  # no call of `forward`, which chooses at the first batch
            if self.budget:
                raise ValueError(
                    f"recompute={self.setting!r} chooses from estimates of "
                    "GradBoostModel's forward at the first batch, and "
                    f"{name}.train_step runs a forward of its own. Call "
                    "`super().train_step(data)` in it, or name the blocks to "
                    'recompute: recompute=["name", ...].'
                )
            self.pending = False  # "auto": the blocks found at compile
            self._warn_unestimated(model, own_step=True)
        segments_chosen = any(i in self.chosen for i, s in enumerate(self.segments) if not s.last)
        if segments_chosen and self.holder is not None and not self.chained:
            raise ValueError(
                f"{name}.train_step made no call of {self.holder.name!r}, and "
                f"recompute={self.setting!r} chose segments of its graph, "
                "which run only inside its calls: they would be silently left "
                "out. Call the model (or that layer) in the step, or name the "
                'layers to recompute: recompute=["name", ...].'
            )
        if segments_chosen and self.holder is None and not self.forwarded:
            raise ValueError(
                f"{name}.train_step runs a forward of its own, and "
                f"recompute={self.setting!r} chose segments of the model's "
                "graph, which only GradBoostModel's forward runs: they would "
                "be silently left out. Call `super().train_step(data)` in it, "
                'or name the layers to recompute: recompute=["name", ...].'
            )

    def forward(self, model, x, only=None, probe=None):
        """The training forward, recomputing the chosen blocks (or `only`
        these keys), or recording each block's operations into `probe`.
        `only=()`: the model's own call, without the segments' chain (the
        reference `recompute_check` compares the chain with)."""
        self.forwarded = True
        chosen = self.chosen if only is None else set(only)
        if only is not None and not chosen and probe is None:
            return _own_call(model, x)
        if self.segments and self.holder is None:
            h = x
            # Each segment's call is Keras' entry call, which clears its
            # layers' losses: a layer used in two segments would lose the
            # first one's. Collected here and added once, after.
            with hooks.collecting_losses() as losses:
                for i, segment in enumerate(self.segments):
                    h = self._run_segment(i, segment, segment, h, chosen, probe)
            for layer, loss in losses:
                keras.layers.Layer.add_loss(layer, loss)
            return h
        with self._calls(chosen, probe):
            return _own_call(model, x)

    def _calls(self, chosen, probe=None):
        """The context in which the model's own call recomputes the `chosen`
        blocks (or records each candidate's operations into `probe`): the
        marked layers, or the calls of the functional layer whose graph the
        segments cut, run as a chain of them (`_chain`)."""
        if self.holder is not None:
            return mechanism.replacing(self.holder, self._chain(chosen, probe))
        if probe is not None:
            return mechanism.probing(probe, self.keys)
        return mechanism.active(chosen, selective=self.selective)

    def _chain(self, chosen, probe):
        """`run(args, kwargs)` for `mechanism.replacing`: a call of the
        holder (a functional model's or a `Sequential`'s `call(inputs,
        training=None, mask=None, **kwargs)`) as the chain of its segments,
        each called as the holder calls its layers (the same `training` and
        call-context arguments), the `chosen` ones recomputed.

        Raises:
            ValueError: the call received a Keras mask, which would not
                cross the cut tensors (`choice.nested_graphs` leaves out a
                holder whose functional graph shows one).
        """
        holder = self.holder

        def run(args, kwargs):
            kwargs = dict(kwargs)
            names = ("inputs", "training", "mask")
            values = dict(zip(names, args))
            values.update((n, kwargs.pop(n)) for n in names if n in kwargs)
            if any(m is not None for m in tf.nest.flatten(values.get("mask"))):
                raise ValueError(
                    f"recompute={self.setting!r} cut the graph of {holder.name!r} "
                    "into segments (its functional graph showed no Keras mask "
                    "reaching it), and this call of it received one, which does "
                    "not cross the cut tensors: its masked layers would run "
                    "unmasked. Recompute it whole instead, "
                    f"recompute=[{holder.name!r}], or name other blocks."
                )
            if probe is None:
                self.chained = True
            h = values["inputs"]
            for i, segment in enumerate(self.segments):
                def call(x, segment=segment):
                    return segment.model(x, training=values.get("training"), **kwargs)

                h = self._run_segment(i, segment, call, h, chosen, probe)
            return h

        return run

    def _run_segment(self, i, segment, call, h, chosen, probe):
        """Segment `i` of a chain on `h`: `call(h)` through `probe`,
        recomputed when chosen (never the last), or as it is."""
        if i:
            segment.check_input(h)
        if probe is not None:
            return probe.run(i, call, h)
        if i in chosen and not segment.last:
            return mechanism.recomputed(
                call,
                mechanism.state_variables(segment.model),
                segment.name,
                segment.model.trainable_variables,
                selective=self.selective,
            )(h)
        return call(h)

    # ----------------------------------------------------- budget and report

    def observe(self, x):
        """Records the per-example input specs of a traced training batch."""
        self.input_spec = tf.nest.map_structure(
            lambda t: tf.TensorSpec(t.shape[1:], t.dtype), x
        )
        batch = tf.nest.flatten(x)[0].shape[0]
        if batch is not None and self.batch_hint is None:
            self.batch_hint = int(batch)

    def _spec(self, model, batch_size):
        if not _has_forward(model):
            return None  # nothing to estimate from
        spec = self.input_spec
        if spec is None and hooks.is_functional(model):
            spec = tf.nest.map_structure(
                lambda t: tf.TensorSpec(t.shape[1:], t.dtype), model.input
            )
        if spec is None or batch_size is None or _unknown_dims(spec):
            # A tensor of unknown shape would count as 0 bytes: no estimate
            # rather than a wrong one.
            return None
        return tf.nest.map_structure(
            lambda s: tf.TensorSpec([batch_size] + list(s.shape), s.dtype), spec
        )

    def _estimate(self, model, spec):
        _build(model, spec)
        overlapping, alone = self._update_buffers(model)
        return estimate(
            model,
            lambda v, p: self.forward(model, v, probe=p),
            spec,
            self.keys,
            selective=self.selective,
            owned={id(l): l.trainable_variables for l in self.layers} or None,
            pile_up=step_gradients_pile_up(model),
            update_buffers=overlapping,
            update_buffers_alone=alone,
        )

    def _estimate_together(self, model, spec, kinds):
        """`_estimate` of each kind of plan (`(layers, segments)` pairs),
        from one traced step where it can be (`_traced_together`): tracing
        is most of a search's time.

        Under a mixed policy set after a graph was built
        (`compile(precision=...)`), a graph run as the chain of its
        segments computes otherwise than its own call (each segment
        converts its input to the dtype it was built in: 1152 bytes kept
        for a residual `Sequential` where its call keeps 896). There each
        kind that runs segments is traced in a forward of its own, and the
        other kinds together in the model's own call.
        """
        _build(model, spec)
        views = []
        for layers, pieces in kinds:
            view = copy.copy(self)
            view.layers, view.segments = layers, pieces
            view.apply()
            views.append(view)
        groups = [list(range(len(views)))]
        if graphs_retyped(model):
            plain = [i for i, v in enumerate(views) if not v.segments]
            groups = [plain] * bool(plain) + [[i] for i, v in enumerate(views) if v.segments]
        estimated = [None] * len(views)
        for group in groups:
            found = self._traced_together(model, spec, [views[i] for i in group])
            for i, figures in zip(group, found):
                estimated[i] = figures
        return estimated

    def _traced_together(self, model, spec, views):
        """`_estimate` of each of `views` (this setup with a kind's blocks)
        from one traced step: the model's own graph run as its segments
        when a view cuts it, each functional layer a view cuts run as the
        chain of its segments, and every view's blocks recorded by a probe
        of its own. A view's blocks run the same operations in any of these
        forwards (where no graph computes in another dtype than it was
        built in), so its figures are those its own trace gives
        (test_nested_graph.py)."""
        own = next((i for i, v in enumerate(views) if v.segments and v.holder is None), None)

        def forward(x, probes):
            replaced = {
                id(v.holder): v._chain(set(), probes[i])
                for i, v in enumerate(views)
                if v.holder is not None
            }
            by_layer = [(probes[i], v.keys) for i, v in enumerate(views) if not v.segments]
            with mechanism.probing_together(by_layer, replaced):
                if own is not None:
                    return views[own].forward(model, x, probe=probes[own])
                return _own_call(model, x)

        overlapping, alone = self._update_buffers(model)
        return estimate_together(
            model,
            forward,
            spec,
            [
                {
                    "keys": v.keys,
                    "selective": self.selective,
                    "owned": {id(l): l.trainable_variables for l in v.layers} or None,
                }
                for v in views
            ],
            pile_up=step_gradients_pile_up(model),
            update_buffers=overlapping,
            update_buffers_alone=alone,
        )

    def _update_buffers(self, model):
        """`update_temporary_counts` of the model's optimizer (overlapping,
        alone), traced once per optimizer."""
        optimizer = getattr(model, "optimizer", None)
        if self._updates is None or self._updates[0] is not optimizer:
            self._updates = (optimizer, update_temporary_counts(optimizer))
        return self._updates[1]

    def _pile_up(self, model):
        """`step_gradients_pile_up` of the current or last `fit` (`note_fit`:
        with its NaNWatcher, gone after it), or of the model now before any
        `fit`. The estimates "auto" and a budget choose by leave out a
        NaNWatcher (`_estimate`), so `recompute_plan()` before `fit` shows
        what `fit` recomputes; the plan's peaks count it."""
        if self.fit_pile_up is _NOT_FITTED:
            return step_gradients_pile_up(model, watcher=_watched(model))
        return self.fit_pile_up

    def note_fit(self, model, callbacks):
        """Records at the start of a `fit` whether its gradients pile up:
        with a `NaNWatcher` among its `callbacks` (a list, a Keras
        `CallbackList` or None), or a watch attached, they do."""
        from keras_gradboost.callbacks.nan_watcher import NaNWatcher  # imports the model

        found = getattr(callbacks, "callbacks", callbacks) or []
        watcher = any(isinstance(c, NaNWatcher) for c in found) or _watched(model)
        self.fit_pile_up = step_gradients_pile_up(model, watcher=watcher)

    def resolve(self, model, x):
        """Chooses the blocks of "auto" or `{"budget_mb": N}` (at the first
        trace).

        "auto" takes, among the plans of both kinds (`search`) that save at
        least `MIN_AUTO_SAVING` of the activation memory and lower the
        estimated training peak (activations and the gradients alive with
        them), the cheapest to recompute within `AUTO_SLACK` of the
        activation memory above the lowest estimate, and else recomputes nothing
        (with a warning); a budget takes the cheapest to recompute whose
        estimated training peak fits.

        Args:
            model: the model.
            x: a training batch's inputs (tensors or `tf.TensorSpec`s).
        """
        self.observe(x)
        spec = self._spec(model, self.batch_hint)
        if spec is None:
            unknown = _unknown_dims(self.input_spec)
            if self.auto:  # nothing to estimate at: the compile-time choice
                self.pending = False
                self._warn_unestimated(model, unknown)
                return
            if unknown:
                raise ValueError(
                    f"recompute={self.setting!r} needs the input shapes to "
                    "estimate activation memory, and the training batches have "
                    f"dimensions of unknown size ({', '.join(unknown)}). Give "
                    "them a fixed size (pad the sequences to one length, e.g. "
                    "`Dataset.padded_batch(..., padded_shapes=...)`), or name "
                    'the blocks instead: recompute=["name", ...].'
                )
            raise ValueError(
                f"recompute={self.setting!r} needs the batch size to estimate "
                "activation memory, and the training batches do not have a "
                'fixed one. Add it: recompute={"budget_mb": '
                f'{self.setting["budget_mb"]:g}, "batch_size": B}}.'
            )
        total, families, layouts, found = self.search(model, spec)
        if self.auto:
            best = auto_choice(total, found, MIN_AUTO_SAVING, AUTO_SLACK)
            fits = bool(best.chosen)
        else:
            best, fits = budget_choice(self.setting["budget_mb"] * MIB, found)
        family, cuts, figures, _ = layouts[best.layout]
        layers, pieces, family_total, sizes = families[family]
        self.layers = layers
        self.segments = resegment(model, pieces, cuts) if pieces else []
        self.chosen = set(best.chosen)
        self.plan = self._plan((family_total, figures, sizes), self.batch_hint, model)
        self.pending = False
        if self.plan.gradients_pile_up == step_gradients_pile_up(model):
            # The figures the choice was made on: no recompute's peak from
            # the finest layout (`candidates`), and the chosen plan's.
            self.plan.peak_bytes_without = found[0].peak
            self.plan.peak_bytes = best.peak if best.chosen else found[0].peak
            if not best.chosen:
                # No recompute's, as its peak: the lowest layout's.
                self.plan.peak_bytes_updates_alone = min(
                    plan_bytes(families[f][2], figures, families[f][3], (),
                               self.plan.gradient_bytes, alone=True)
                    for f, _, figures, _ in layouts
                )
            if _counts_eigen_buffers(self.plan):
                # On the figures of the choice, and what the others reach.
                free = peaks_without_buffers(
                    found,
                    [(families[f][2], figures, families[f][3]) for f, _, figures, _ in layouts],
                    self.plan.gradient_bytes,
                )
                mine = next(p for c, p in zip(found, free) if c is best)
                self.plan.working_buffer_bytes = max(0, self.plan.peak_bytes - mine)
                self.plan.lowest_unbuffered_bytes = min(free)
        elif self.budget and self.plan.peak_bytes > self.setting["budget_mb"] * MIB:
            over = self.plan.peak_bytes - self.setting["budget_mb"] * MIB
            warnings.warn(
                f"recompute={self.setting!r}: the plan chosen is estimated at "
                f"~{self.plan.peak_bytes / MIB:.1f} MiB in this fit, "
                f"~{over / MIB:.1f} MiB over the budget: "
                f"{self.plan.gradients_pile_up}, which holds every gradient "
                f"(~{self.plan.gradient_bytes / MIB:.1f} MiB) until the backward "
                "ends. Raise the budget by that much, or train without the "
                "NaNWatcher.",
                stacklevel=2,
            )
        if fits:
            return
        temporary = self.plan.xla_temporary_bytes  # found by `_plan` above
        removable = (
            f" The training peak includes ~{temporary / MIB:.1f} MiB that the XLA "
            f"backward of the depthwise convolution {self.plan.xla_temporary_layer!r} "
            "allocates " + self.plan.xla_temporary_remedy + "."
            if temporary
            else ""
        ) + _eigen_advice(
            self.plan,
            min(estimated_peak(c) for c in found),
            self.setting["budget_mb"] * MIB if self.budget else None,
        )
        if self.auto:
            plans = [c for c in found if c.chosen]
            lowest = min(c.bytes for c in plans) if plans else total
            lowest_peak = min(estimated_peak(c) for c in plans) if plans else None
            warnings.warn(
                f'recompute="auto": no plan of recompute is estimated to save '
                f"{MIN_AUTO_SAVING:.0%} of the activation memory and lower the "
                f"training peak at batch size {self.batch_hint} (activations "
                f"without recompute ~{total / MIB:.1f} MiB, the lowest plan's "
                f"~{lowest / MIB:.1f} MiB; training peak without recompute "
                f"~{estimated_peak(found[0]) / MIB:.1f} MiB"
                + (f", the lowest plan's ~{lowest_peak / MIB:.1f} MiB" if plans else "")
                + "): nothing is recomputed."
                + _unsplit(
                    self.plan.blocks,
                    total,
                    {p[0].holder.name for _, p, _, _ in families if p and p[0].holder},
                    retyped(model),
                )
                + " Lower the batch size (with accumulate_steps to keep the "
                "effective batch) or use mixed precision to save memory."
                + removable,
                stacklevel=2,
            )
            return
        where = (
            f"recompute={self.setting!r}: the training peak (activations and "
            "the gradients alive with them) cannot be brought under "
            f"{self.setting['budget_mb']:g} MiB at batch size {self.batch_hint}"
        )
        advice = (
            "Lower the batch size (with accumulate_steps to keep the effective "
            "batch), use mixed precision, or raise the budget." + removable
        )
        if best.chosen:
            warnings.warn(
                f"{where}; the best estimate, recomputing {len(best.chosen)} of "
                f"{len(self.keys)} blocks, is {estimated_peak(best) / MIB:.1f} MiB "
                f"(without recompute: {estimated_peak(found[0]) / MIB:.1f} MiB). "
                f"{advice}",
                stacklevel=2,
            )
        else:
            warnings.warn(
                f"{where}, and no plan of recompute is estimated to save "
                f"memory (without recompute: {estimated_peak(found[0]) / MIB:.1f} "
                f"MiB): nothing is recomputed. {advice}",
                stacklevel=2,
            )

    def _warn_unestimated(self, model, unknown=(), own_step=False):
        """Says that "auto" recomputes the blocks found at compile, unestimated,
        and what would let it estimate (`unknown`: `_unknown_dims`;
        `own_step`: the model's `train_step` ran no forward of
        GradBoostModel's)."""
        names = self.names()
        chosen = [str(names[k]) for k in self.keys if k in self.chosen]
        if not chosen:
            return  # nothing recomputed: nothing to doubt
        if own_step:
            why = (
                f"{type(model).__name__}.train_step runs a forward of its own, "
                "which the estimates do not trace"
            )
            fix = "Call `super().train_step(data)` in it, or name the blocks"
        elif not _has_forward(model):
            why = f"{type(model).__name__} has no `call` of its own to estimate"
            fix = "Name the blocks"
        elif unknown:
            why = (
                "the training batches have dimensions of unknown size "
                f"({', '.join(unknown)})"
            )
            fix = (
                "Give them a fixed size (pad the sequences to one length, e.g. "
                "`Dataset.padded_batch(..., padded_shapes=...)`), or name the "
                "blocks"
            )
        else:
            why = "the batch size is not known before the first batch"
            fix = (
                "Pass `fit` arrays, a `tf.data.Dataset`, a `keras.utils.PyDataset` "
                "or a generator (their batch size is read before training), or "
                "name the blocks"
            )
        blocks = f"{len(chosen)} block{'s' * (len(chosen) > 1)}"
        warnings.warn(
            f'recompute="auto" cannot estimate the activation memory: {why}. '
            f"It recomputes the {blocks} found at compile ({', '.join(chosen)}) "
            "without knowing whether that lowers the training peak. "
            f'{fix}: recompute=["name", ...].',
            stacklevel=2,
        )

    def search(self, model, spec):
        """Estimates each kind of plan "auto" and a budget choose among
        (`choice.search_families`: the nested blocks, and the segments of
        the model's graph or of a functional layer's) at `spec`, all from
        one traced step (`_estimate_together`), and lists the plans.

        Returns:
            `(total, families, layouts, found)`: bytes without recompute;
            per family `(layers, segments, total, sizes)`; per layout
            `(family, cut indices or None, figures, keys)`; and the
            `Candidate`s, whose `layout` indexes `layouts`.
        """
        families, layouts, found = [], [], []
        _build(model, spec)  # (an unbuilt `Sequential` has no graph to cut yet)
        kinds = search_families(model)
        estimated = self._estimate_together(model, spec, kinds)
        gradients = _gradient_bytes(model)
        for (layers, pieces), (family_total, per_block, sizes) in zip(kinds, estimated):
            self.layers, self.segments = layers, pieces
            family = len(families)
            families.append((layers, pieces, family_total, sizes))
            mine = []
            if pieces:
                all_cuts, cut_sets = segment_layouts(graph_of(model, pieces))
                for cuts in cut_sets:
                    groups = groups_of(all_cuts, cuts)
                    keys = list(range(len(groups) - 1))  # the last is never recomputed
                    mine.append((family, cuts, merge(per_block, sizes, groups), keys))
            else:
                # Never a block that reads a weight of another layer of its
                # holder: the mechanism refuses to nest it (tied weights).
                # (Recomputed without its holder it would work; such plans
                # are left out too, for simplicity. A layer also called
                # outside its holder has no parent here, and is not caught.)
                tied = set(tied_inner_blocks(per_block))
                keys = [k for k in self.keys if k not in tied]
                mine.append((family, None, per_block, keys))
            offset = len(layouts)
            layouts.extend(mine)
            for c in candidates(
                family_total, [(f, k) for _, _, f, k in mine], sizes, gradients
            ):
                if c.chosen or not found:  # recomputing nothing: once
                    found.append(dataclasses.replace(c, layout=c.layout + offset))
                elif c.peak < found[0].peak:  # ... at the finest family's figures
                    found[0] = dataclasses.replace(found[0], peak=c.peak)
        return families[0][2], families, layouts, found

    def _plan(self, estimated, batch_size, model):
        total, per_block, sizes = estimated
        per_block = with_pile_up(per_block, self._pile_up(model))
        gradients = _gradient_bytes(model)
        names = self.names()
        rows = [
            BlockEstimate(
                name=names[k],
                recomputed=k in self.chosen,
                cached_bytes=per_block[k]["cached"],
                input_bytes=per_block[k]["inputs"],
                recompute_flops=per_block[k]["flops"],
            )
            for k in self.keys
        ]
        temporary, layer = depthwise.xla_backward_temporary(model)
        peak = plan_bytes(total, per_block, sizes, self.chosen, gradients)
        eigen_dtypes = _eigen_convolution_dtypes(model)
        plan = RecomputePlan(
            setting=self.setting,
            batch_size=batch_size,
            blocks=rows,
            bytes_without=total,
            bytes_with=plan_bytes(total, per_block, sizes, self.chosen),
            gradient_bytes=gradients,
            peak_bytes=peak,
            peak_bytes_updates_alone=plan_bytes(
                total, per_block, sizes, self.chosen, gradients, alone=True
            ),
            peak_bytes_without=plan_bytes(total, per_block, sizes, (), gradients),
            gradients_pile_up=self._pile_up(model),
            eigen_convolutions=bool(eigen_dtypes),
            eigen_dtypes=eigen_dtypes,
            xla_temporary_bytes=temporary,
            xla_temporary_layer=layer.name if layer is not None else None,
            xla_temporary_remedy=depthwise.temporary_remedy(
                layer, xla=bool(model.jit_compile) or depthwise.xla_clusters()
            ) if layer is not None else "",
            pointwise_convolutions=_pointwise_convolutions(model),
        )
        if _counts_eigen_buffers(plan):
            unbuffered = without_working_buffers(per_block)
            plan.working_buffer_bytes = peak - plan_bytes(
                total, unbuffered, sizes, self.chosen, gradients
            )
        return plan

    def report(self, model, batch_size=None):
        """A `RecomputePlan` with estimates when the input shapes are known,
        and the last fit's measured peak when it ran at that batch size."""
        self._settle(model)
        batch_size = batch_size or self.batch_hint
        plan = self._report(model, batch_size)
        if self.measured is not None and plan.batch_size is not None and (
            self.measured[1] == plan.batch_size
        ):
            (plan.measured_peak_bytes, _, plan.measured_slot_bytes,
             plan.measured_replicas) = self.measured
        return plan

    def _report(self, model, batch_size):
        if self.pending:  # what the first trace would choose, not committed
            spec = self._spec(model, batch_size)
            if spec is not None:
                trial = copy.copy(self)
                trial.batch_hint = batch_size
                trial.resolve(model, spec)
                return trial.plan
            if not self.auto:
                return RecomputePlan(setting=self.setting)
            # "auto" without a batch size: the blocks chosen at compile().
        if (
            self.plan is not None
            and batch_size == self.plan.batch_size
            and self.plan.gradients_pile_up == self._pile_up(model)
        ):
            return self.plan
        spec = self._spec(model, batch_size)
        if spec is None:
            names = self.names()
            return RecomputePlan(
                setting=self.setting,
                blocks=[
                    BlockEstimate(names[k], k in self.chosen, 0, 0, 0.0)
                    for k in self.keys
                ],
            )
        estimated = self._estimate(model, spec)
        total, per_block, _ = estimated
        plan = self._plan(estimated, batch_size, model)
        if self.selective:
            # The moments of the backward from the per-block figures; the
            # step's own trace catches what they miss (kernel outputs they
            # do not find, inputs kept for the replays).
            kept = kept_bytes(model, lambda v, _: self.forward(model, v), spec)
            plan.bytes_with = selective_plan_bytes(total, per_block, self.chosen, kept)
            figures = with_pile_up(per_block, plan.gradients_pile_up)
            plan.peak_bytes = selective_plan_bytes(
                total, figures, self.chosen, kept, plan.gradient_bytes
            )
            plan.peak_bytes_updates_alone = selective_plan_bytes(
                total, figures, self.chosen, kept, plan.gradient_bytes, alone=True
            )
            if _counts_eigen_buffers(plan):
                plan.working_buffer_bytes = plan.peak_bytes - selective_plan_bytes(
                    total, without_working_buffers(figures), self.chosen, kept,
                    plan.gradient_bytes,
                )
        return plan


# `RecomputeSetup.fit_pile_up` before any `fit`.
_NOT_FITTED = object()


def _watched(model):
    """Whether a NaNWatcher's watch is attached to `model` now."""
    checks = getattr(model, "_checks_steps", None)  # GradBoostModel's
    return bool(checks and checks()) and not checks(watches=False)

# What `RecomputeSetup._choice` sets, and `_settle` keeps per signature.
_KEPT = ("layers", "segments", "chosen", "plan", "pending")


def _dtype_signature(model):
    """Per layer of `model` (by id), its compute dtype and autocast."""
    return {
        id(layer): (layer.compute_dtype, getattr(layer, "autocast", True))
        for layer in hooks.flatten_layers(model)
    }


def _same_policies(a, b):
    """Whether two `_dtype_signature`s agree on the layers both have."""
    return all(a[k] == b[k] for k in a.keys() & b.keys())


def _build(model, spec):
    """Builds the layers a model builds at its first call (a subclassed
    one's), by tracing its forward at `spec`, if the model is not built yet
    (a layer its training call never reaches stays unbuilt: not traced
    again for it at each estimate).

    Built inside an estimate's traced step, their weights' initial values
    landed in the blocks' operations and each block's weights were not yet
    its own: a subclassed model's first `fit` estimated its first kind of
    plan as if each residual block also held the layer before it (39.3
    KFLOP to recompute instead of 12.9) and "auto" chose the blocks whole
    instead of the blocks and the blocks inside them.
    """
    if model.built:
        return
    tf.function(lambda x: _own_call(model, x), autograph=False).get_concrete_function(spec)


def _own_call(model, x):
    """The model's own training call on `x`."""
    if hooks.call_has_training_arg(model):
        return model(x, training=True)
    return model(x)


def _eigen_convolution_dtypes(model):
    """The compute dtypes of the model's convolutions that run on
    TensorFlow's Eigen kernels (`eigen_convolution_kernels`), as sorted
    names (`RecomputePlan.eigen_dtypes`)."""
    return tuple(sorted({
        tf.as_dtype(layer.dtype_policy.compute_dtype).name
        for layer in hooks.flatten_layers(model, include_self=False)
        if "Conv" in type(layer).__name__
        and eigen_convolution_kernels(model, layer.dtype_policy.compute_dtype)
    }))


def _counts_eigen_buffers(plan):
    """Whether `plan`'s peaks count working buffers of Eigen's convolution
    kernels alone (`RecomputePlan.working_buffer_bytes`): with an XLA
    depthwise temporary too, its own line says what removes it first."""
    return plan.eigen_convolutions and not plan.xla_temporary_bytes


def _eigen_advice(plan, lowest, budget_bytes=None):
    """For a warning that no plan fits a budget (`budget_bytes`) or that
    "auto" recomputes nothing: what the plans would reach without the
    working buffers of Eigen's convolution kernels, when that is below the
    `lowest` they reach with them, and what removes them ("" otherwise)."""
    if plan.lowest_unbuffered_bytes is None or plan.lowest_unbuffered_bytes >= lowest:
        return ""
    reach = f"without them the plans reach ~{plan.lowest_unbuffered_bytes / MIB:.1f} MiB"
    if budget_bytes is not None:
        reach += (
            ", under the budget" if plan.lowest_unbuffered_bytes <= budget_bytes
            else ", still over it"
        )
    removers = []
    if onednn_would_take(plan.eigen_dtypes):
        removers.append(
            "TF_ENABLE_ONEDNN_OPTS=1 runs the float32 and bfloat16 convolutions "
            "on oneDNN, without them"
        )
    if "float16" in plan.eigen_dtypes:
        removers.append(
            "oneDNN leaves float16 convolutions to these kernels: another "
            "precision policy runs them on oneDNN"
        )
    if plan.pointwise_convolutions:
        n = plan.pointwise_convolutions
        removers.append(
            f'compile(pointwise="matmul") runs the {n} 1x1 Conv2D layer{"s" * (n != 1)} '
            "as matmuls, without theirs"
        )
    if not removers:
        return ""
    held = (
        f"~{plan.working_buffer_bytes / MIB:.1f} MiB at this plan's"
        if plan.working_buffer_bytes
        else "none at this plan's, more at others'"
    )
    return (
        " The training peaks include the working buffers of TensorFlow's Eigen "
        f"convolution kernels ({held}), which recompute cannot remove; {reach}: "
        + "; ".join(removers) + "."
    )


def _pointwise_convolutions(model):
    """How many 1x1 `Conv2D` layers of `model` run on TensorFlow's Eigen
    kernels that `compile(pointwise="matmul")` would run as matmuls (none
    when it is on: `RecomputePlan.pointwise_convolutions`)."""
    config = getattr(model, "gradboost_config", None)
    if getattr(config, "pointwise", None) == "matmul":
        return 0
    return sum(
        1
        for layer in pointwise.candidates(model)
        if eigen_convolution_kernels(model, layer.dtype_policy.compute_dtype)
    )


def _unknown_dims(spec):
    """`"<input> axis <i>"` for each per-example dimension of unknown size
    in the input specs `spec` (without their batch axis)."""
    found = []
    for path, s in _flatten_with_paths(spec):
        if s.shape.rank is None:
            found.append(f"{path or 'input'} (unknown rank)")
            continue
        for axis, size in enumerate(s.shape):
            if size is None:
                found.append(f"{path or 'input'} axis {axis + 1}")
    return found


def _flatten_with_paths(spec):
    if isinstance(spec, dict):
        return [(repr(k), v) for k, v in spec.items()]
    flat = tf.nest.flatten(spec)
    if len(flat) == 1:
        return [("", flat[0])]
    return [(f"input {i}", v) for i, v in enumerate(flat)]


def _gradient_bytes(model):
    """Bytes of the trainable variables' gradients (one per variable, in its
    dtype); `plan_bytes` places each at its moment of the backward."""
    return sum(variable_bytes(v) for v in model.trainable_variables)


def _replicas_sharing(model, device):
    """How many of `model`'s replicas allocate from `device`'s allocator:
    a MirroredStrategy's logical CPU devices share the CPU's; a GPU holds
    one replica, and so does each worker of a MultiWorkerMirroredStrategy
    with one CPU."""
    if model is None or not device.startswith("CPU"):
        return 1
    try:
        devices = model.distribute_strategy.extended.worker_devices
    except (RuntimeError, NotImplementedError):  # the default strategy: one
        return 1
    return max(1, sum(tf.DeviceSpec.from_string(name).device_type == "CPU" for name in devices))


def _memory_level():
    """`(device, bytes in use)` after resetting the device allocator's peak,
    or None where it keeps no statistics."""
    device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    try:
        tf.config.experimental.reset_memory_stats(device)
        return device, tf.config.experimental.get_memory_info(device)["current"]
    except (ValueError, RuntimeError):
        return None


def batch_size_hint(fit_args):
    """The batch size `fit` will draw, when it can be told in advance.

    Args:
        fit_args: `fit`'s arguments as a dict (`x`, `batch_size`, ...). A
            generator `fit_args["x"]` is replaced by one that yields its first
            batch, read here, again.

    Returns:
        An int, or None: `x` is none of arrays, a `tf.data.Dataset`, a
        `keras.utils.PyDataset` or a generator, or yields nothing.
    """
    x = fit_args.get("x")
    if isinstance(x, tf.data.Dataset):
        size = tf.nest.flatten(x.element_spec)[0].shape[0]
        if size is None:  # batches of no fixed size: look at the first
            size = _leading_size(next(iter(x.take(1))))
        return size
    if isinstance(x, keras.utils.PyDataset):
        if x.num_batches == 0:  # Keras says so
            return None
        # Keras reads its first batches too, for their specs.
        return _leading_size(x[0])
    if isinstance(x, types.GeneratorType):
        try:
            first = next(x)
        except StopIteration:  # an empty generator: Keras says so
            return None
        fit_args["x"] = _yielding_again(first, x)
        return _leading_size(first)
    arrays = [a for a in tf.nest.flatten(x) if hasattr(a, "shape")]
    if arrays and x is not None:
        batch = fit_args.get("batch_size") or 32
        return min(batch, int(arrays[0].shape[0]))
    return None


def _leading_size(batch):
    """The batch size of a batch `x`, `(x, y)` or `(x, y, sample_weight)`
    (None for an empty one)."""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
    shape = getattr(tf.nest.flatten(x)[0], "shape", None)
    return int(shape[0]) if shape and shape[0] else None


def _yielding_again(first, rest):
    """A generator (Keras accepts only those) yielding `first`, then `rest`."""
    yield first
    yield from rest
