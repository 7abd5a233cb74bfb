"""The budget's search: coarse segments merged from fine ones agree with a
direct estimate, a smaller budget never gets a larger estimate, "auto"'s plan
is never beaten by the budget's, and nothing is recomputed when nothing
saves."""

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_gradboost as kgb
from conftest import grappler
from keras_gradboost import recompute
from keras_gradboost import zoo
from keras_gradboost.recompute.estimates import plan_layout
from recompute.models import flat_model
from recompute.models import wide_model

MIB = recompute.MIB


def mobilenet():
    keras.utils.set_random_seed(0)
    return kgb.boost(
        keras.applications.MobileNetV2(input_shape=(32, 32, 3), weights=None, classes=3)
    )


MODELS = {
    "MobileNetV2": (mobilenet, (32, 32, 3), 8),
    "zoo.cnn": (lambda: zoo.cnn(), (32, 32, 3), 32),
    "zoo.residual_mlp": (lambda: zoo.residual_mlp(blocks=4, width=64), (784,), 64),
    "zoo.transformer": (lambda: zoo.transformer(), (32,), 16),
    "flat_model": (lambda: flat_model(), (5,), 64),
    "wide_model": (lambda: wide_model(), (64,), 256),
}


def _spec(shape, batch, name):
    dtype = "int32" if name == "zoo.transformer" else "float32"
    return tf.TensorSpec((batch,) + shape, dtype)


def _auto_plan(build, spec):
    """`recompute="auto"`'s plan, traced with its own blocks."""
    model = build()
    model.compile(optimizer="sgd", loss="mse", recompute="auto")
    return model.recompute_plan(batch_size=spec.shape[0])


@pytest.mark.parametrize("name", list(MODELS))
def test_budget_sweep_is_monotonic_and_never_worse_than_auto(name):
    grappler(False)  # the default set-up: gradients by moments (the fixture restores it)
    build, shape, batch = MODELS[name]
    spec = _spec(shape, batch, name)
    auto = _auto_plan(build, spec)
    model = build()
    model.compile(optimizer="sgd", loss="mse", recompute={"budget_mb": 1.0})
    setup = model._gradboost.recompute
    total, _, _, found = setup.search(model, spec)
    # "auto"'s plan is a candidate: merged from the fine estimate, the same
    # bytes and training peak as its own trace.
    assert (auto.bytes_with, auto.peak_bytes) in [(c.bytes, c.peak) for c in found]
    # No recompute's training peak: the gradients alive at a moment are
    # counted per block, so the finest layout's estimate, the lowest.
    without = found[0].peak
    assert without <= auto.peak_bytes_without
    budgets = np.linspace(1.1 * without, 0.0, 41)
    chosen = [recompute.budget_choice(b, found) for b in budgets]
    estimates = [c.peak for c, _ in chosen]
    assert all(b <= a for a, b in zip(estimates, estimates[1:])), estimates
    for budget, (candidate, fits) in zip(budgets, chosen):
        assert candidate.peak <= without  # never worse than no recompute
        assert fits == (candidate.peak <= budget)
        if budget <= auto.peak_bytes:
            assert candidate.peak <= auto.peak_bytes
    assert estimates[0] == without and chosen[0][0].chosen == ()


def test_auto_takes_the_cheapest_plan_within_its_slack_of_the_lowest():
    """Plans whose estimates are closer than the estimates' error cannot be
    told apart: "auto" takes the cheapest to recompute within its slack (a
    share of the activations) above the lowest, never one that saves less
    than its gate or lowers no peak."""
    from keras_gradboost.recompute.budget import Candidate

    nothing = Candidate(0, (), 100, 0.0, 200)
    lowest = Candidate(0, (0, 1, 2), 30, 9.0, 80)
    near = Candidate(0, (0, 1), 40, 6.0, 87)
    edge = Candidate(1, (1,), 45, 5.0, 90)  # 80 + 0.1 * 100: still within
    beyond = Candidate(0, (0,), 60, 2.0, 91)
    gated = Candidate(0, (2,), 95, 0.5, 85)  # saves 5% of the activations
    found = [nothing, beyond, near, gated, edge, lowest]
    assert recompute.auto_choice(100, found, 0.1, 0.1) is edge
    assert recompute.auto_choice(100, found, 0.1, 0.09) is near
    assert recompute.auto_choice(100, found, 0.1, 0.0) is lowest
    assert recompute.auto_choice(100, found, 0.0, 0.1) is gated  # no gate
    # Gradients alive in every plan add to every peak: the same choice.
    held = [dataclasses.replace(c, peak=c.peak + 1000) for c in found]
    chosen = recompute.auto_choice(100, held, 0.1, 0.1)
    assert (chosen.layout, chosen.chosen) == (edge.layout, edge.chosen)
    # Nothing lowers the peak: nothing is recomputed, whatever the slack.
    same = Candidate(0, (0,), 50, 1.0, 200)
    assert recompute.auto_choice(100, [nothing, same], 0.1, 1.0) is nothing
    # Never recompute for less than the slack: within it of no recompute,
    # only the lowest.
    little = Candidate(0, (0,), 80, 1.0, 195)
    least = Candidate(0, (0, 1), 70, 3.0, 188)
    assert recompute.auto_choice(100, [nothing, little, least], 0.1, 0.1) is least
    # Costs equal up to rounding (the same blocks in another layout): the
    # lower estimate.
    other = dataclasses.replace(edge, layout=2, flops=5.0 * (1 + 1e-12), peak=85)
    assert recompute.auto_choice(100, found + [other], 0.1, 0.1) is other


def test_merged_segments_match_a_direct_estimate():
    """Merging the every-cut segments into the layout "auto" chose gives,
    block by block, the figures of tracing those segments themselves (a
    step traced with the chosen segments as the blocks, not merged)."""
    model = flat_model()
    model.compile(optimizer="sgd", loss="mse", recompute="auto")
    spec = tf.TensorSpec((64, 5))
    plan = model.recompute_plan(batch_size=64)
    fine = recompute.RecomputeSetup(model, {"budget_mb": 1.0})
    total, families, layouts, _ = fine.search(model, spec)
    (_, _, _, sizes), = families  # no nested blocks: the segments only
    _, all_cuts = recompute.cut_points(model)
    names = [b.name for b in plan.blocks]
    (chosen,) = [  # the layout "auto" chose (its segments' names)
        i for i, (_, cuts, _, _) in enumerate(layouts)
        if [p.name for p in recompute.segments(model, cuts=cuts)] == names
    ][:1]
    auto_cuts, merged = layouts[chosen][1], layouts[chosen][2]
    assert len(recompute.groups_of(all_cuts, auto_cuts)) == len(plan.blocks) >= 3
    # The chosen segments traced as the blocks themselves.
    direct = recompute.RecomputeSetup(model, {"budget_mb": 1.0})
    direct.layers, direct.segments = [], recompute.segments(model, cuts=auto_cuts)
    direct.apply()
    direct_total, traced, traced_sizes = direct._estimate(model, spec)
    assert total == direct_total == plan.bytes_without
    for index, block in enumerate(plan.blocks):
        assert merged[index]["cached"] == traced[index]["cached"] == block.cached_bytes, block.name
        assert merged[index]["inputs"] == traced[index]["inputs"] == block.input_bytes, block.name
        assert merged[index]["flops"] == pytest.approx(traced[index]["flops"])
    keys = [index for index, block in enumerate(plan.blocks) if block.recomputed]
    assert keys and set(keys) <= set(layouts[chosen][3])
    assert (recompute.plan_bytes(total, merged, sizes, keys)
            == recompute.plan_bytes(direct_total, traced, traced_sizes, keys)
            == plan.bytes_with)
    # Every plan of every layout, not only the chosen one: the activations
    # made outside every block until a block's end (`outside_before`) were
    # left out of merged figures, which then counted all of them at every
    # moment (28928 bytes for a plan a trace of its segments puts at 26880).
    gradients = plan.gradient_bytes
    for _, cuts, figures, keys in layouts:
        if len(keys) > 6:  # (finer layouts merge less; 4 s more of CI)
            continue
        direct.segments = recompute.segments(model, cuts=cuts)
        direct.apply()
        _, traced, traced_sizes = direct._estimate(model, spec)
        for count in range(len(keys) + 1):
            for some in itertools.combinations(keys, count):
                assert (recompute.plan_bytes(total, figures, sizes, some, gradients)
                        == recompute.plan_bytes(direct_total, traced, traced_sizes, some,
                                                gradients)), (cuts, some)


def test_budget_at_autos_estimate_is_no_worse_through_compile():
    build, shape, batch = MODELS["flat_model"]
    auto = _auto_plan(build, tf.TensorSpec((batch,) + shape))
    model = build()
    model.compile(
        optimizer="sgd", loss="mse",
        recompute={"budget_mb": auto.peak_bytes / MIB, "batch_size": batch},
    )
    plan = model.recompute_plan()
    assert plan.peak_bytes <= auto.peak_bytes
    assert plan.peak_bytes < plan.peak_bytes_without


def test_a_budget_through_compile_reports_a_peak_within_it():
    """The plan a budget takes on a segmented graph reports the training
    peak the choice was made on: within the budget when it fits (no
    warning), and no recompute's from the same search."""
    build, shape, batch = MODELS["flat_model"]
    auto = _auto_plan(build, tf.TensorSpec((batch,) + shape))
    for budget in np.linspace(auto.peak_bytes, auto.peak_bytes_without, 5)[1:]:
        model = build()
        model.compile(optimizer="sgd", loss="mse",
                      recompute={"budget_mb": budget / MIB, "batch_size": batch})
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a budget out of reach warns
            plan = model.recompute_plan()
        assert plan.peak_bytes <= budget
        assert plan.peak_bytes_without == auto.peak_bytes_without


def _nothing_saves():
    """A Dense, four Rescalings and a head: the backward keeps only the
    Dense's and the head's inputs, which no segment holds inside (a
    Rescaling's gradient needs no value), so recomputing any segment only
    adds its input to what is kept."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(8, name="dense_0")(inputs)
    for i in range(4):
        h = keras.layers.Rescaling(2.0, name=f"scale_{i}")(h)
    return kgb.GradBoostModel(inputs, keras.layers.Dense(3, name="head")(h))


def test_when_nothing_saves_the_budget_warns_and_recomputes_nothing():
    model = _nothing_saves()
    model.compile(optimizer="sgd", loss="mse", recompute={"budget_mb": 1e-6})
    x, y = np.zeros((32, 8), "float32"), np.zeros((32, 3), "float32")
    with pytest.warns(UserWarning, match="no plan of recompute is estimated to save"):
        model.fit(x, y, batch_size=32, verbose=0)
    plan = model.recompute_plan()
    assert plan.recomputed == []
    assert plan.bytes_with == plan.bytes_without
    # "auto" would recompute them all, estimated no better.
    auto = _nothing_saves()
    auto.compile(optimizer="sgd", loss="mse", recompute="auto")
    assert auto.recompute_plan(batch_size=32).bytes_with >= plan.bytes_without


def _two_back_cells(cells=8, width=64):
    """A flat graph whose cells each read the two cells before them (as
    NASNet's do): after the first cell no single tensor carries everything,
    so one segment holds nearly all the activations."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    before, last = inputs, keras.layers.Dense(width, activation="relu", name="cell_0")(inputs)
    before = keras.layers.Dense(width, name="lift")(before)
    for i in range(1, cells):
        mixed = keras.layers.Add(name=f"mix_{i}")([before, last])
        before, last = last, keras.layers.Dense(width, activation="relu", name=f"cell_{i}")(mixed)
    return kgb.GradBoostModel(inputs, keras.layers.Dense(3, name="head")(last))


def test_auto_says_why_when_one_uncuttable_segment_holds_the_activations():
    model = _two_back_cells()
    model.compile(optimizer="sgd", loss="mse", recompute="auto")
    with pytest.warns(UserWarning, match="nothing is recomputed. One block, '.*', holds") as record:
        plan = model.recompute_plan(batch_size=512)
    assert plan.recomputed == []
    largest = max(plan.blocks, key=lambda b: b.cached_bytes)
    assert largest.cached_bytes >= 0.5 * plan.bytes_without  # the sentence's premise
    assert repr(largest.name) in str(record[0].message)


def test_auto_names_a_keras_mask_as_a_reason_nothing_can_be_cut():
    # keras.io's text models: the mask that Embedding(mask_zero=True) makes
    # crosses every point of the graph beside the activations, to the
    # pooling that reads it, so no single tensor carries everything.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((24,), dtype="int32")
    h = keras.layers.Embedding(50, 64, mask_zero=True)(inputs)
    for i in range(8):
        h = keras.layers.Dense(64, activation="tanh", name=f"d{i}")(h)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    model = kgb.GradBoostModel(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse", recompute="auto")
    with pytest.warns(UserWarning, match="nothing is recomputed.*mask_zero=True"):
        assert model.recompute_plan(batch_size=256).recomputed == []


def test_candidates_recompute_nothing_when_no_block_saves():
    figures = {
        k: {"cached": 10, "inputs": 20, "flops": 1.0, "inside": {f"t{k}"}, "input_roots": {f"in{k}": 20}}
        for k in range(3)
    }
    sizes = {f"t{k}": 10 for k in range(3)}
    found = recompute.candidates(30, [(figures, [0, 1, 2])], sizes)
    assert found[0] == recompute.Candidate(0, (), 30, 0.0)
    # "auto"'s plan, and the same without the block the backward meets first
    assert [c.chosen for c in found[1:]] == [(0, 1, 2), (0, 1)]
    assert found[1].bytes > 30
    assert recompute.budget_choice(1, found) == (found[0], False)
    assert recompute.budget_choice(30, found) == (found[0], True)


@pytest.mark.parametrize(
    "chosen, peak",
    [
        ((), 35),  # everything kept
        ((0, 1, 2), 15),  # what no block holds, and one block rebuilt
        ((0, 1), 15),  # the last block kept: the same peak
        ((2,), 35),  # only the last: its rebuild comes first, nothing saved
        ((1, 2), 25),  # block 0 kept while block 1 is rebuilt
        ((0,), 25),  # blocks 1 and 2 kept at the end of the forward
    ],
)
def test_the_peak_follows_the_backward_from_the_last_block(chosen, peak):
    # Three blocks of 10 bytes each (in forward order), 5 bytes held by no
    # block, inputs kept anyway. By hand: at the end of the forward every
    # kept block is alive; the backward reaches block 2, then 1, then 0, and
    # at block i the blocks before it keep what they keep while block i's
    # 10 bytes are all alive (kept or rebuilt).
    figures = {
        k: {"cached": 10, "inputs": 1, "flops": 1.0, "inside": {f"t{k}"},
            "input_roots": {f"out{k - 1}": 1}}
        for k in range(3)
    }
    sizes = {**{f"t{k}": 10 for k in range(3)}, "out-1": 1, "out0": 1, "out1": 1, "rest": 2}
    assert recompute.plan_bytes(35, figures, sizes, chosen) == peak


@pytest.mark.parametrize(
    "chosen, peak",
    [
        ((), 65),  # everything kept
        ((0, 1), 35),  # flat: one whole block rebuilt, the other kept
        ((0,), 35),
        # Nested: a block's replay holds its activations less its nested
        # blocks' (30 - 22), and then the larger nested block's (12).
        ((0, "0a", "0b", 1, "1a", "1b"), 5 + 8 + 12),
        ((0, "0a", "0b", "1a", "1b"), 5 + 8 + 12),  # block 1 kept but for its nested ones
        (("1a", "1b"), 5 + 30 + 8 + 12),  # block 0 kept whole at block 1's moment
    ],
)
def test_blocks_recomputed_inside_recomputed_blocks(chosen, peak):
    """Two blocks of 30 bytes (in forward order), each holding two nested
    blocks of 10 and 12 bytes and 8 bytes of its own (the first nested
    block's output, the second's input); 5 bytes held by no block. By hand:
    a nested block inside a recomputed one is recomputed in its replay
    (`mechanism`), so that replay holds 8 bytes, then 8 + 12 during the
    second nested block's own replay."""
    figures = {}
    for k in (0, 1):
        figures[k] = {"cached": 30, "inputs": 1, "flops": 3.0,
                      "inside": {f"a{k}", f"b{k}", f"m{k}"}, "input_roots": {f"out{k - 1}": 1}}
        figures[f"{k}a"] = {"cached": 10, "inputs": 1, "flops": 1.0, "inside": {f"a{k}"},
                            "input_roots": {f"out{k - 1}": 1}, "parent": k}
        figures[f"{k}b"] = {"cached": 12, "inputs": 8, "flops": 1.0, "inside": {f"b{k}"},
                            "input_roots": {f"m{k}": 8}, "parent": k}
    sizes = {"out-1": 1, "out0": 1, "rest": 3}
    for k in (0, 1):
        sizes.update({f"a{k}": 10, f"b{k}": 12, f"m{k}": 8})
    assert sum(sizes.values()) == 65
    assert recompute.plan_bytes(65, figures, sizes, chosen) == peak


def _nested_figures(tops):
    """`tops` blocks in a row as above (30 bytes, flops 3), each with two
    nested blocks (10 bytes and 12, flops 1 each; 8 bytes of the block's
    own between them), 3 bytes held by no block: `(figures, sizes)`."""
    figures, sizes = {}, {"rest": 3}
    for k in range(tops):
        top = f"t{k}"
        figures[top] = {"cached": 30, "inputs": 1, "flops": 3.0,
                        "inside": {f"a{k}", f"b{k}", f"m{k}"}, "input_roots": {f"o{k - 1}": 1}}
        figures[top + "a"] = {"cached": 10, "inputs": 1, "flops": 1.0, "inside": {f"a{k}"},
                              "input_roots": {f"o{k - 1}": 1}, "parent": top}
        figures[top + "b"] = {"cached": 12, "inputs": 8, "flops": 1.0, "inside": {f"b{k}"},
                              "input_roots": {f"m{k}": 8}, "parent": top}
        sizes.update({f"a{k}": 10, f"b{k}": 12, f"m{k}": 8, f"o{k}": 1})
    return figures, sizes


def _every_plan(figures, sizes):
    """`(estimate, flops)` of every plan of the blocks, by brute force."""
    total, keys = sum(sizes.values()), list(figures)
    return [
        (recompute.plan_bytes(total, figures, sizes, chosen),
         sum(figures[k]["flops"] for k in chosen))
        for n in range(len(keys) + 1)
        for chosen in itertools.combinations(keys, n)
    ]


def test_a_budget_on_a_few_nested_blocks_takes_the_cheapest_plan_that_fits():
    # Ranked each alone, a block and its nested ones missed the plans in
    # between: at 6 of these 10 budgets a costlier plan was taken (under 53
    # bytes a whole block, 3, where one nested block, 1, fits; under 34 the
    # first block and every nested one, 7, where the nested ones, 4, fit).
    figures, sizes = _nested_figures(2)
    found = recompute.candidates(sum(sizes.values()), [(figures, list(figures))], sizes)
    every = _every_plan(figures, sizes)
    for budget in sorted({estimate for estimate, _ in every}):
        chosen, fits = recompute.budget_choice(budget, found)
        assert fits and chosen.bytes <= budget
        assert chosen.flops == min(f for estimate, f in every if estimate <= budget), budget


def test_beyond_every_plan_the_walk_finds_cheaper_plans_than_the_ranking(monkeypatch):
    # 15 nested blocks: 32768 plans, past `EVERY_PLAN_BLOCKS`. Brute force
    # bounds the walk's plans from below; without it (the ranked prefixes
    # alone) 79 of these 88 budgets took a costlier plan than the cheapest.
    from keras_gradboost.recompute import budget as budget_lib

    figures, sizes = _nested_figures(5)
    assert len(figures) > budget_lib.EVERY_PLAN_BLOCKS
    layouts = [(figures, list(figures))]
    found = recompute.candidates(sum(sizes.values()), layouts, sizes)
    monkeypatch.setattr(budget_lib, "_walk", lambda *args: [])
    ranked = recompute.candidates(sum(sizes.values()), layouts, sizes)
    every = _every_plan(figures, sizes)
    cheaper = optimal = 0
    budgets = sorted({estimate for estimate, _ in every})
    for budget in budgets:
        chosen, fits = recompute.budget_choice(budget, found)
        before, _ = recompute.budget_choice(budget, ranked)
        best = min(f for estimate, f in every if estimate <= budget)
        assert fits and best <= chosen.flops <= before.flops
        cheaper += chosen.flops < before.flops
        optimal += chosen.flops == best
    assert cheaper >= len(budgets) // 2 and optimal > sum(
        recompute.budget_choice(b, ranked)[0].flops == min(f for e, f in every if e <= b)
        for b in budgets
    ), (cheaper, optimal)


@pytest.mark.parametrize(
    "chosen, placed, peak",
    [
        (("inner",), True, 1 + 3 + 10),  # its replay, and what the block made before it
        (("inner",), False, 1 + 12 + 10),  # without the figures: all the block's own
        (("block", "inner"), True, 1 + 3 + 10),  # the same inside the block's replay
        ((), True, 23),  # the end of the forward: everything
        (("block",), True, 23),  # the block's replay holds it all
    ],
)
def test_a_nested_replay_holds_what_its_block_made_before_it(chosen, placed, peak):
    """A block of 22 bytes: 3 of its own made before its nested block (the
    nested block's input), the nested block's 10, its output (4, read after
    it) and 5 more made after it; 1 byte (the block's input) outside. By
    hand: when the backward reaches the nested block, the block's
    activations made after it are freed, and its forward output too when
    it replays (keras-hub GPT-2, "auto": 58.1 MiB requested, 69.6 estimated
    with them, 61.1 without)."""
    figures = {
        "block": {"cached": 22, "inputs": 1, "flops": 2.0, "input_roots": {"x": 1},
                  "inside": {"before", "inner", "out", "after"}},
        "inner": {"cached": 10, "inputs": 3, "flops": 1.0, "inside": {"inner"},
                  "input_roots": {"before": 3}, "parent": "block"},
    }
    if placed:
        figures["inner"].update(parent_before=3, parent_outputs=4)
    sizes = {"x": 1, "before": 3, "inner": 10, "out": 4, "after": 5}
    assert recompute.plan_bytes(23, figures, sizes, chosen) == peak


@pytest.mark.parametrize("parallel, peak", [(True, 1 + 3 + 6 + 10), (False, 1 + 3 + 10)])
def test_a_nested_replay_holds_a_kept_branch_beside_it(parallel, peak):
    """A block of 19 bytes: 3 of its own, then two nested blocks, `a` (10,
    recomputed) and `b` (6, kept). When `b` is made from `a`, its backward
    is done before `a`'s replay; beside it (a parallel residual, both read
    the block's input) it may not be, and counts."""
    figures = {
        "block": {"cached": 19, "inputs": 1, "flops": 2.0, "input_roots": {"x": 1},
                  "inside": {"before", "a", "b"}},
        "a": {"cached": 10, "inputs": 3, "flops": 1.0, "inside": {"a"},
              "input_roots": {"before": 3}, "parent": "block", "parent_before": 3,
              "parent_outputs": 0, "parallel": ["b"] if parallel else []},
        "b": {"cached": 6, "inputs": 3, "flops": 1.0, "inside": {"b"},
              "input_roots": {"before": 3}, "parent": "block", "parent_before": 3,
              "parent_outputs": 0, "parallel": []},
    }
    sizes = {"x": 1, "before": 3, "a": 10, "b": 6}
    assert recompute.plan_bytes(20, figures, sizes, ["a"]) == peak


@pytest.mark.parametrize(
    "chosen, peak",
    [
        ((), 35),  # the end of the forward: everything
        ((0, 1, 2), 2 + 10),  # block 1's moment: its rebuild, the 2 made before it
        ((1, 2), 2 + 10 + 10),  # block 1's moment: block 0 kept, block 1 rebuilt
        # The last alone: at its moment the head's 3 are freed (32); at the
        # end of the forward its activations are not alive (25).
        ((2,), 2 + 20 + 10),
    ],
)
def test_activations_outside_the_blocks_count_only_at_moments_after_them(chosen, peak):
    """Of the 5 bytes no block holds, 1 is made before block 0, 1 more
    before block 1 and 3 after block 2 (a head): the backward frees the
    head's before it reaches block 2, and block 1's surroundings before
    block 0. Counted at every moment, user lists that leave most of a model
    outside their blocks read far too high (GPT-2, a layer and the
    attention blocks: 140.9 MiB estimated, 90.3 requested; now 81.8)."""
    figures = {
        k: {"cached": 10, "inputs": 1, "flops": 1.0, "inside": {f"t{k}"},
            "input_roots": {f"out{k - 1}": 1}, "outside_before": (1, 2, 2)[k]}
        for k in range(3)
    }
    sizes = {**{f"t{k}": 10 for k in range(3)}, "out-1": 1, "out0": 1, "out1": 1, "rest": 2}
    assert recompute.plan_bytes(35, figures, sizes, chosen) == peak


@pytest.mark.parametrize(
    "chosen, head, peak, selective_peak",
    [
        # Blocks 0, 1 rebuilt, 2 kept: at block 2's moment its 10 bytes,
        # its weights' 20 and its largest tensor's 3: 33, on top of the 5
        # held by no block and the 2 of gradients never placed. Selective:
        # blocks 0, 1 hold their kernel outputs (4 each) then.
        ((0, 1), 5, 5 + 33 + 2, 5 + 8 + 33 + 2),
        # Nothing recomputed: blocks 0, 1 kept (20) at block 2's moment.
        ((), 5, 5 + 20 + 33 + 2, 5 + 20 + 33 + 2),
        # A head of 50: its moment comes first, with block 2 kept (10);
        # selective, with blocks 0, 1's kernel outputs too.
        ((0, 1), 50, 5 + 10 + 50 + 2, 5 + 8 + 10 + 50 + 2),
    ],
)
def test_the_training_peak_counts_each_blocks_gradients_at_its_moment(
        chosen, head, peak, selective_peak):
    grappler(False)  # the default set-up (the fixture restores it)
    # As above, and weights: block 0 reads 4 bytes, block 1 6, block 2 20,
    # a head after block 2 reads `head`, a stem before block 0 reads 7 (its
    # gradient comes last, when no block keeps anything), 2 bytes no block
    # reads. Each block's largest tensor is 3 bytes (the gradient flowing
    # through it).
    figures = {
        k: {"cached": 10, "inputs": 1, "flops": 1.0, "inside": {f"t{k}"},
            "input_roots": {f"out{k - 1}": 1}, "weights": {f"w{k}": (4, 6, 20)[k]},
            "largest": 3, "after": {}, "before": {}}
        for k in range(3)
    }
    figures[2]["after"] = {"head": head}
    figures[0]["before"] = {"stem": 7}
    sizes = {**{f"t{k}": 10 for k in range(3)}, "out-1": 1, "out0": 1, "out1": 1, "rest": 2}
    gradients = 4 + 6 + 20 + head + 7 + 2
    assert recompute.plan_bytes(35, figures, sizes, chosen, gradients) == peak
    # The budget's candidates pass each layout's shared moments, found once
    # (`plan_layout`): the same peak; a layout of other gradient bytes is
    # refused, not used.
    layout = plan_layout(figures, gradients)
    assert recompute.plan_bytes(35, figures, sizes, chosen, gradients, layout) == peak
    with pytest.raises(ValueError, match="`layout` was found for other gradient bytes"):
        recompute.plan_bytes(35, figures, sizes, chosen, None, layout)
    with pytest.raises(ValueError, match="`layout` was found for other figures"):
        recompute.plan_bytes(35, dict(figures), sizes, chosen, gradients, layout)
    # Without the gradients: the activations alone, as before.
    assert recompute.plan_bytes(35, figures, sizes, chosen) == (15 if chosen else 35)
    # The same blocks chosen by the selective policy, 4 bytes of each
    # block's 10 being kernel layers' outputs: the same moments.
    selective = {k: {**f, "kernel_cached": 4} for k, f in figures.items()}
    assert recompute.selective_plan_bytes(35, selective, chosen, 0, gradients) == (
        selective_peak)


@pytest.mark.parametrize(
    "chosen, checked, tied, peak",
    [
        # After a check, the updates run in turn once the backward ends:
        # each moment has the gradients made until it. Nothing recomputed:
        # block 2's moment, blocks 0, 1 kept (20), its own 10, the head's 5
        # and its 20 of gradients, its largest 3; the 5 held by no block and
        # the 2 never placed.
        ((), True, False, 5 + 20 + 10 + (5 + 20) + 3 + 2),
        # The head reads block 0's weight too (tied): its gradient exists
        # from the head's moment on.
        ((), True, True, 5 + 20 + 10 + (5 + 4 + 20) + 3 + 2),
        # Blocks 0, 1 rebuilt: the end of the backward, every gradient (44)
        # with the updates' 9 in turn, over block 0's moment (5 + 10 + 35
        # + 3 + 2 = 55).
        ((0, 1), True, False, 5 + 44 + 9),
        # Updates at once (grappler's dependency optimizer off): every
        # gradient and the updates' 8 counted at every moment.
        ((), False, False, 35 + 44 + 8),
        ((0, 1), False, False, 5 + 10 + 44 + 8),  # a block's 10 alive at each moment
    ],
)
def test_piled_up_gradients_count_as_made_when_the_updates_wait_for_a_check(
        chosen, checked, tied, peak):
    from keras_gradboost.recompute import updates

    # The figures of the test above (head 5), every gradient waiting for
    # the end of the backward.
    reason = updates.CHECKED if checked else "grappler's dependency optimizer is off"
    figures = {
        k: {"cached": 10, "inputs": 1, "flops": 1.0, "inside": {f"t{k}"},
            "input_roots": {f"out{k - 1}": 1}, "weights": {f"w{k}": (4, 6, 20)[k]},
            "largest": 3, "after": {}, "before": {}, "gradients_pile_up": reason,
            "update_bytes": 8, "update_bytes_in_turn": 9}
        for k in range(3)
    }
    figures[2]["after"] = {"head": 5, **({"w0": 4} if tied else {})}
    figures[0]["before"] = {"stem": 7}
    sizes = {**{f"t{k}": 10 for k in range(3)}, "out-1": 1, "out0": 1, "out1": 1, "rest": 2}
    assert recompute.plan_bytes(35, figures, sizes, chosen, 4 + 6 + 20 + 5 + 7 + 2) == peak


@pytest.mark.parametrize("buffers, alone, peak, peak_alone", [
    # No activations; each update holds 2 buffers of its weight's size and
    # runs as its gradient arrives, while the backward makes the next
    # weight's gradient. Block 2's moment: its 20 with the update's 40 and
    # block 1's 6 next, and the gradient flowing through it (3). Each
    # update alone holds 1 beside its gradient, and nothing else is made
    # meanwhile: 20 * 2 + 3.
    (2, 1, 20 * 3 + 6 + 3, 20 * 2 + 3),
    # An update that holds nothing: each moment's own gradients alone.
    (0, 0, 20 + 3, 20 + 3),
])
@pytest.mark.parametrize("more", [False, True])
def test_an_update_counts_with_the_next_weights_gradient(buffers, alone, peak, peak_alone, more):
    figures = {
        k: {"cached": 0, "inputs": 0, "flops": 1.0, "inside": set(), "input_roots": {},
            "weights": {f"w{k}": (4, 6, 20)[k]}, "largest": 3, "after": {},
            "before": {}, "update_buffers": buffers, "update_buffers_alone": alone}
        for k in range(3)
    }
    figures[2]["after"] = {"head": 5}  # its moment: 5 * 3 + block 2's 20 = 35
    figures[0]["before"] = {"stem": 7}  # the last: 7 * 3
    gradients = 4 + 6 + 20 + 5 + 7
    if more:
        # Two more weights in block 1, 24 and 22: 52 with its 6, more than
        # 24 with one buffer. Alone, each of them is freed by its update
        # before the next comes: the largest with its buffer, 48 (+ 3),
        # now the peak. Overlapping: the largest with two buffers and the
        # next one (22), above block 2's, whose next is now 24.
        figures[1]["weights"].update(w1b=24, w1c=22)
        gradients += 24 + 22
        if buffers:
            peak, peak_alone = 24 * 3 + 22 + 3, 24 * 2 + 3
        else:  # no update buffers: each moment's gradients, summed, either way
            peak = peak_alone = 6 + 24 + 22 + 3
    assert recompute.plan_bytes(0, figures, {}, (), gradients) == peak
    assert recompute.plan_bytes(0, figures, {}, (), gradients, alone=True) == peak_alone
    # A selective plan's moments count the gradients the same way.
    assert recompute.selective_plan_bytes(0, figures, (), 0, gradients) == peak
    assert recompute.selective_plan_bytes(0, figures, (), 0, gradients, alone=True) == peak_alone
    # The figures of a layout estimated for many plans give the same.
    layout = plan_layout(figures, gradients)
    assert recompute.plan_bytes(0, figures, {}, (), gradients, layout, alone=True) == peak_alone


def test_groups_of_cover_every_fine_segment_once():
    assert recompute.groups_of([3, 5, 9, 12], (5, 12)) == [(0, 1), (2, 3), (4,)]
    assert recompute.groups_of([3, 5], (3, 5)) == [(0,), (1,), (2,)]


MEASURE = r"""
import json
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf
from recompute.models import wide_model

model = wide_model()
model.compile(optimizer="adam", loss="mse", recompute="auto")
x, y = np.zeros((256, 64), "float32"), np.zeros((256, 3), "float32")
fits = []
for _ in range(2):  # the first fit creates Adam's moments, the second none
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model.fit(x, y, batch_size=64, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    plan = model.recompute_plan()
    fits.append({
        "measured": plan.measured_peak_bytes, "outside": peak - before,
        "slots": plan.measured_slot_bytes, "peak_estimate": plan.peak_bytes,
        "estimate": plan.bytes_with, "text": str(plan),
        "weights": sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights),
        "other_batch": model.recompute_plan(batch_size=32).measured_peak_bytes,
    })
print(json.dumps(fits))
"""


def test_plan_shows_the_fits_measured_peak():
    """With allocator statistics (TensorFlow's BFC allocator on a CPU), the
    plan carries the fit's allocator peak, as measured around the fit from
    outside; at another batch size it has none. A first fit with Adam
    creates its moments (twice the weights' bytes), which no estimate
    counts: the plan compares the rest with its estimate (ConvNeXtTiny's
    first fit read 4.08x the estimate with them, 0.93x without)."""
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "2"}
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")]
    )
    out = subprocess.run(
        [sys.executable, "-c", MEASURE], capture_output=True, text=True, env=env, timeout=300
    )
    first, second = json.loads(out.stdout.strip().splitlines()[-1])
    for result in (first, second):
        assert result["measured"] == result["outside"] > result["estimate"] > 0
        assert "measured in the last fit: allocator peak" in result["text"]
        assert result["other_batch"] is None
    # Adam's two moments per weight (its step counter and learning rate
    # exist before the fit).
    assert first["slots"] == 2 * first["weights"]
    rest = first["measured"] - first["slots"]
    assert (f"of which ~{first['slots'] / MIB:.1f} MiB the optimizer variables it created"
            in first["text"])
    assert f"{rest / first['peak_estimate']:.2f}x the estimate" in first["text"]
    assert second["slots"] == 0 and "optimizer variables it created" not in second["text"]
    assert f"{second['measured'] / second['peak_estimate']:.2f}x the estimate" in second["text"]


@pytest.mark.parametrize("slots, said, replicas", [
    (0, None, 1), (3 * 1024, "of which ~3.0 KiB", 1), (4 * MIB, "of which ~4.0 MiB", 1),
    (4 * MIB, "of which ~4.0 MiB", 2),
])
def test_the_measured_line_takes_off_what_it_names(slots, said, replicas):
    """Whatever the optimizer variables a fit created weigh, the plan names
    them before it compares the rest with its estimate; with replicas on
    logical CPU devices (one allocator), with that many estimates."""
    plan = recompute.RecomputePlan(
        setting="auto", batch_size=4, bytes_without=10 * MIB, bytes_with=6 * MIB,
        gradient_bytes=2 * MIB, peak_bytes=8 * MIB, peak_bytes_without=12 * MIB,
        measured_peak_bytes=12 * MIB, measured_slot_bytes=slots, measured_replicas=replicas,
    )
    text = str(plan)
    ratio = (12 * MIB - slots) / (replicas * 8 * MIB)
    if replicas == 1:
        assert f"{ratio:.2f}x the estimate (" in text and "replicas" not in text
    else:
        assert f"{ratio:.2f}x the estimate of 2 replicas (2 logical CPU devices" in text
    assert ("optimizer variables it created" in text) is bool(said)
    assert said is None or said in text


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_plan_shows_its_estimate_with_each_update_alone_where_lower(replicas):
    """The low end of the estimate (`peak_bytes_updates_alone`) is printed
    where it is lower by 1% or more, and the measured peak is compared with
    it as with `peak_bytes` (per replica)."""
    plan = recompute.RecomputePlan(
        setting="auto", batch_size=4, bytes_without=10 * MIB, bytes_with=6 * MIB,
        gradient_bytes=2 * MIB, peak_bytes=8 * MIB, peak_bytes_updates_alone=6 * MIB,
        peak_bytes_without=12 * MIB, measured_peak_bytes=12 * MIB, measured_slot_bytes=0,
        measured_replicas=replicas,
    )
    text = str(plan)
    assert "~6.0 MiB with each optimizer update alone" in text
    assert f"{12 / (replicas * 8):.2f}x the estimate" in text
    assert f"and {12 / (replicas * 6):.2f}x the one with each update alone" in text
    for same in (7.95 * MIB, 8 * MIB, None):
        text = str(dataclasses.replace(plan, peak_bytes_updates_alone=same))
        assert "update alone" not in text, same


def test_the_measured_line_of_replicas_sharing_the_cpus_allocator():
    """MirroredStrategy on two logical CPU devices (conftest.py's, with the
    BFC allocator): both replicas' bytes, and both copies of Adam's moments,
    are in the CPU allocator's peak; the plan says so rather than compare
    them with one replica's estimate."""
    from conftest import shared_mirrored_strategy
    from recompute.models import residual_model

    with shared_mirrored_strategy().scope():
        model = residual_model()
        model.compile(optimizer="adam", loss="mse", recompute="auto")
    model.fit(np.zeros((64, 5), "float32"), np.zeros((64, 3), "float32"),
              batch_size=16, verbose=0)
    plan = model.recompute_plan()
    weights = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights)
    assert plan.measured_peak_bytes is not None  # (the allocator keeps statistics)
    assert plan.measured_replicas == 2
    assert plan.measured_slot_bytes == 2 * 2 * weights  # two moments, two copies
    assert "the estimate of 2 replicas (2 logical CPU devices share one allocator" in str(plan)


def test_a_fit_measured_over_its_budget_warns_with_the_figures():
    """The estimates meet a budget; the allocator's peak, measured around
    the fit, can exceed it: that is said with both figures. A budget far
    under the lowest plan (which warns at the choice too) is measured over;
    one at 3x no recompute's estimate is not."""
    build, shape, batch = MODELS["flat_model"]
    x = np.zeros((2 * batch,) + shape, "float32")
    y = np.zeros((2 * batch, 3), "float32")
    for budget_mb, over in ((0.01, True), (None, False)):
        model = build()
        if budget_mb is None:  # 3x no recompute's estimated training peak
            auto = _auto_plan(build, tf.TensorSpec((batch,) + shape))
            budget_mb = 3 * auto.peak_bytes_without / MIB
        model.compile(optimizer="adam", loss="mse",  # (its slots: no budget counts them)
                      recompute={"budget_mb": budget_mb, "batch_size": batch})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=batch, verbose=0)
        measured = model.recompute_plan().measured_peak_bytes
        assert measured and (measured > budget_mb * MIB) == over, (measured, budget_mb)
        said = [str(w.message) for w in caught if "allocator peak" in str(w.message)]
        if over:
            assert len(said) == 1 and f"{measured / MIB:.1f} MiB above" in said[0], said
            assert f"budget of {budget_mb:g} MiB" in said[0] and "plan estimated" in said[0]
        else:
            assert not said, said


@pytest.mark.filterwarnings("ignore:recompute=.*cannot be brought under")
def test_a_real_architecture_over_its_budget_warns_and_names_adams_moments():
    """keras.applications MobileNetV2 (32x32, batch 8) with Adam, under a
    budget no plan fits: the first fit's allocator peak is over it, said
    with the figures, without the Adam moments that fit created, which
    the plan also takes off (and names) before it compares with its
    estimate."""
    build, shape, batch = MODELS["MobileNetV2"]
    model = build()
    model.compile(optimizer="adam", loss="mse",
                  recompute={"budget_mb": 0.01, "batch_size": batch})
    x = np.zeros((2 * batch,) + shape, "float32")
    y = np.zeros((2 * batch, 3), "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=batch, verbose=0)
    plan = model.recompute_plan()
    moments = 2 * sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights)  # float32
    assert plan.measured_slot_bytes == moments
    said = [str(w.message) for w in caught if "allocator peak" in str(w.message)]
    measured = plan.measured_peak_bytes
    assert len(said) == 1 and f"{measured / MIB:.1f} MiB above" in said[0], said
    assert f"({(measured - moments) / MIB:.1f} MiB without the optimizer's slots" in said[0]
    rest = (measured - moments) / plan.peak_bytes
    assert (f"of which ~{moments / MIB:.1f} MiB the optimizer variables it created"
            in str(plan)) and f"{rest:.2f}x the estimate (" in str(plan)


def test_a_fit_over_its_budget_is_told_only_for_a_budget(monkeypatch):
    """Measured over "budget_mb" (the allocator's reply faked: 3 MiB): a
    warning; none under it, with recompute by names, in a fit that did not
    choose the plan (it may run at another batch size), on two replicas
    (logical devices share one allocator), or once the optimizer's slots
    the fit made (which no budget counts) are taken off."""
    monkeypatch.setattr(tf.config.experimental, "get_memory_info",
                        lambda device: {"current": 0, "peak": peak})
    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", lambda device: None)

    def fake_model(replicas=1):
        optimizer = types.SimpleNamespace(built=False, variables=[])
        strategy = types.SimpleNamespace(
            num_replicas_in_sync=replicas,
            extended=types.SimpleNamespace(worker_devices=("/device:CPU:0",) * replicas),
        )
        return types.SimpleNamespace(optimizer=optimizer, distribute_strategy=strategy)

    budget = {"budget_mb": 1.0}
    cases = [  # setting, peak, replicas, chosen before, slots made, warns
        (budget, 3 * MIB, 1, False, 0, True),
        (budget, MIB // 2, 1, False, 0, False),
        (["up_*"], 3 * MIB, 1, False, 0, False),
        (budget, 3 * MIB, 1, True, 0, False),
        (budget, 3 * MIB, 2, False, 0, False),
        (budget, 3 * MIB, 1, False, 2.5 * MIB, False),
        (budget, 3 * MIB, 1, False, 1 * MIB, True),
    ]
    for setting, peak, replicas, chosen, slots, warns in cases:
        setup = recompute.RecomputeSetup(
            None if isinstance(setting, dict) else flat_model(), setting
        )
        setup.pending = not chosen
        model = fake_model(replicas)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            setup.start_measuring(model)
            if slots:  # Adam's slots, built by the fit
                model.optimizer.variables.append(tf.Variable(tf.zeros(int(slots) // 4)))
            setup.stop_measuring(model)
        assert setup.measured[0] == peak
        said = [str(w.message) for w in caught]
        case = (setting, peak, replicas, chosen, slots)
        if warns:
            assert len(said) == 1 and "3.0 MiB above the level before it" in said[0], case
            assert "over the budget of 1 MiB" in said[0] and "budget_mb" in said[0], case
            assert ("2.0 MiB without the optimizer's slots" in said[0]) == bool(slots), case
        else:
            assert not said, (case, said)


@pytest.mark.parametrize("reply", ["raises", "zeros"])
def test_without_allocator_statistics_nothing_is_measured(monkeypatch, reply):
    """An allocator that keeps no statistics raises, or (TensorFlow's
    default CPU allocator on some builds) answers zeros."""

    def memory_info(device):
        if reply == "raises":
            raise ValueError(f"no statistics on {device}")
        return {"current": 0, "peak": 0}

    monkeypatch.setattr(tf.config.experimental, "get_memory_info", memory_info)
    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", lambda device: None)
    setup = recompute.RecomputeSetup(None, {"budget_mb": 1.0})
    setup.start_measuring()
    setup.stop_measuring()
    assert setup.measured is None
    plan = recompute.RecomputePlan(setting="auto", batch_size=8, bytes_without=1, bytes_with=1)
    assert "measured" not in str(plan)
