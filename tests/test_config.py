import pytest

from keras_gradboost.config import GradBoostConfig


def test_defaults_are_inactive():
    config = GradBoostConfig()
    assert config.accumulate_steps == 1
    assert config.precision is None
    assert config.loss_scale == "auto"
    assert not config.active


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"accumulate_steps": 0}, ValueError, "accumulate_steps=0. Expected an int >= 1"),
        ({"accumulate_steps": -3}, ValueError, "accumulate_steps=-3"),
        ({"accumulate_steps": 2**63}, ValueError, "(the micro-batch counter is an int64)"),
        ({"accumulate_steps": 2.0}, TypeError, "accumulate_steps=2.0"),
        ({"accumulate_steps": True}, TypeError, "accumulate_steps=True"),
        ({"accumulate_steps": "4"}, TypeError, "accumulate_steps='4'"),
        ({"precision": "fp16"}, ValueError, "precision='fp16'"),
        ({"precision": 16}, TypeError, "precision=16"),
        ({"loss_scale": "static"}, ValueError, "loss_scale='static'"),
        ({"loss_scale": 0.0}, ValueError, "loss_scale=0.0"),
        ({"loss_scale": -2}, ValueError, "loss_scale=-2"),
        ({"loss_scale": float("inf")}, ValueError, "loss_scale=inf"),
        ({"loss_scale": 1e39}, ValueError, "loss_scale=1e+39"),
        ({"loss_scale": True}, TypeError, "loss_scale=True"),
        ({"loss_scale": [2.0]}, TypeError, "loss_scale=[2.0]"),
    ],
)
def test_bad_values_name_argument_value_and_expectation(kwargs, error, fragment):
    with pytest.raises(error) as info:
        GradBoostConfig(**kwargs)
    message = str(info.value)
    name = next(iter(kwargs))
    assert f"Invalid value for argument `{name}`" in message
    assert fragment in message
    assert "Expected" in message


@pytest.mark.parametrize(
    "kwargs, field, value",
    [
        ({"accumulate_steps": 4}, "accumulate_steps", 4),
        ({"precision": "mixed_bfloat16"}, "precision", "mixed_bfloat16"),
        ({"precision": "auto"}, "precision", "auto"),
        ({"precision": "measure"}, "precision", "measure"),
        ({"loss_scale": 128}, "loss_scale", 128.0),
        ({"loss_scale": None}, "loss_scale", None),
        ({"loss_scale": "dynamic"}, "loss_scale", "dynamic"),
    ],
)
def test_good_values_are_normalised(kwargs, field, value):
    config = GradBoostConfig(**kwargs)
    assert getattr(config, field) == value
    assert type(getattr(config, field)) is type(value)
    assert config.active


def test_to_dict_round_trips():
    config = GradBoostConfig(accumulate_steps=2, loss_scale=None)
    assert config.to_dict() == {
        "accumulate_steps": 2,
        "precision": None,
        "loss_scale": None,
        "recompute": None,
        "recompute_check": False,
        "accumulate_check": False,
        "depthwise": None,
        "pointwise": None,
    }
    assert GradBoostConfig(**config.to_dict()) == config
    native = GradBoostConfig(depthwise="native", pointwise="matmul")
    assert GradBoostConfig(**native.to_dict()) == native
    config = GradBoostConfig(recompute=["a", "b*"], recompute_check=True)
    assert config.recompute == ("a", "b*")
    assert config.to_dict()["recompute"] == ["a", "b*"]  # JSON-friendly
    assert GradBoostConfig(**config.to_dict()) == config
    budget = GradBoostConfig(recompute={"budget_mb": 100, "batch_size": 8})
    assert budget.recompute == {"budget_mb": 100.0, "batch_size": 8}
    assert GradBoostConfig(**budget.to_dict()) == budget


@pytest.mark.parametrize(
    "value, stored",
    [
        ({"policy": "selective"}, {"policy": "selective", "blocks": "auto"}),
        ({"policy": "selective", "blocks": ["enc_*"]},
         {"policy": "selective", "blocks": ("enc_*",)}),
        ({"policy": "full"}, "auto"),
        ({"policy": "full", "blocks": ["enc_*"]}, ("enc_*",)),
    ],
)
def test_recompute_policies_are_normalised_and_round_trip(value, stored):
    config = GradBoostConfig(recompute=value)
    assert config.recompute == stored
    assert GradBoostConfig(**config.to_dict()) == config


@pytest.mark.parametrize(
    "value, error, fragment",
    [
        ({"policy": "partial"}, ValueError, 'a "policy" of "full" or "selective"'),
        ({"policy": 2}, TypeError, 'a "policy" of "full" or "selective"'),
        ({"policy": "selective", "budget_mb": 64}, ValueError, "Set only one"),
        ({"policy": "selective", "layers": ["a"]}, ValueError, "(unknown: ['layers'])"),
        ({"policy": "selective", "blocks": None}, ValueError, '"blocks" as "auto"'),
        ({"policy": "selective", "blocks": "enc"}, ValueError, "write ['enc']"),
    ],
)
def test_bad_recompute_policies_name_the_value(value, error, fragment):
    with pytest.raises(error) as info:
        GradBoostConfig(recompute=value)
    message = str(info.value)
    assert f"Invalid value for argument `recompute`. Received: recompute=" in message
    assert fragment in message
