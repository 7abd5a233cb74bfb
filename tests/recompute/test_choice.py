"""Choosing blocks: "auto", names and glob patterns, graph segments at cut
points, the budget's candidates, and the errors that say what exists."""

import pytest

import keras
from keras_gradboost import GradBoostModel
from keras_gradboost import recompute
from recompute.models import WIDTH
from recompute.models import ResBlock
from recompute.models import assert_same_state
from recompute.models import flat_model
from recompute.models import residual_model
from recompute.models import train


def test_auto_splits_a_stack_into_its_blocks():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    stack = keras.Sequential([ResBlock(name=f"s_{i}") for i in range(3)], name="stack")
    outputs = keras.layers.Dense(3)(stack(keras.layers.Dense(WIDTH)(inputs)))
    model = GradBoostModel(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse", recompute="auto")
    assert model.recompute_plan().recomputed == ["s_0", "s_1", "s_2"]


def test_patterns_match_nested_layers_and_a_miss_lists_blocks():
    model = residual_model()
    model.compile(optimizer="sgd", loss="mse", recompute=["res_[02]", "head"])
    assert model.recompute_plan().recomputed == ["res_0", "res_2", "head"]
    with pytest.raises(ValueError, match=r"'encoder_\*' matches no layer.*res_0"):
        model.compile(optimizer="sgd", loss="mse", recompute=["encoder_*"])
    # The failed compile changed nothing.
    assert model.recompute_plan().recomputed == ["res_0", "res_2", "head"]


def test_auto_without_blocks_or_cuts_says_what_to_do():
    class Flat(GradBoostModel):
        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(4)

        def call(self, x):
            return self.a(x)

    with pytest.raises(ValueError, match="found nothing to recompute.*Name the layers"):
        Flat().compile(optimizer="sgd", loss="mse", recompute="auto")


@pytest.mark.parametrize(
    "value, error",
    [
        ("res_0", ValueError),
        (["res_0", 3], ValueError),
        ([], ValueError),
        ({"budget_mb": 0}, ValueError),
        ({"budget_mb": 10, "batch": 3}, ValueError),
        (True, TypeError),
        (3, TypeError),
    ],
)
def test_bad_recompute_values(value, error):
    with pytest.raises(error, match="Invalid value for argument `recompute`"):
        residual_model().compile(optimizer="sgd", loss="mse", recompute=value)


def test_cut_points_of_a_branching_graph():
    inputs = keras.Input((4,))
    a = keras.layers.Dense(4, name="a")(inputs)
    b1 = keras.layers.Dense(4, name="b1")(a)
    b2 = keras.layers.Dense(4, name="b2")(a)
    c = keras.layers.Add(name="c")([b1, b2])
    d = keras.layers.Dense(4, name="d")(c)
    model = keras.Model(inputs, keras.layers.Dense(2, name="e")(d))
    calls, cuts = recompute.cut_points(model)
    # After a, c and d one tensor carries everything; not inside the branch.
    assert [calls[i][0].name for i in cuts] == ["a", "c", "d"]


def test_flat_model_segments_auto(data):
    x, y = data
    plain, rc = flat_model(), flat_model()
    train(plain, x, y)
    train(rc, x, y, recompute="auto")
    plan = rc.recompute_plan()
    # 13 layer calls -> segments; of the plans the search weighed, the
    # cheapest to recompute within "auto"'s slack of the lowest estimate,
    # which here is not the lowest.
    assert len(plan.blocks) >= 3
    setup = rc._gradboost.recompute
    total, _, _, found = setup.search(rc, setup._spec(rc, 16))
    plans = [c for c in found if c.chosen and c.bytes <= 0.9 * total]
    lowest = min(c.peak for c in plans)
    window = [c for c in plans if c.peak <= lowest + recompute.AUTO_SLACK * total]
    flops = sum(b.recompute_flops for b in plan.blocks if b.recomputed)
    assert flops == pytest.approx(min(c.flops for c in window))
    assert plan.peak_bytes <= lowest + recompute.AUTO_SLACK * total
    assert flops < min(c.flops for c in plans if c.peak == lowest)
    assert_same_state(plain, rc)

