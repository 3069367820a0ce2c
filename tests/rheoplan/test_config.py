"""Configuration validation: bad values fail early, naming the parameter."""

from __future__ import annotations

import pytest

from rheoplan.config import ConfigError, SamplingConfig, TreeConfig


@pytest.mark.parametrize("kwargs, name", [
    (dict(depth=0), "depth"), (dict(depth=65), "depth"), (dict(depth=2.0), "depth"),
    (dict(frontier=0), "frontier"), (dict(slots=0), "slots"), (dict(budget=0), "budget"),
    (dict(rheostat=9, slots=8), "rheostat"), (dict(rheostat=-1), "rheostat"),
    (dict(support=4, slots=8), "support"), (dict(verifier="greedy"), "verifier"),
    (dict(proxy="q"), "proxy"), (dict(depth=True), "depth"),
])
def test_tree_config_errors_name_the_parameter(kwargs, name):
    with pytest.raises(ConfigError, match=rf"^{name}"):
        TreeConfig(**kwargs)


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"), (dict(temperature="1"), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
])
def test_sampling_config_errors_name_the_parameter(kwargs, name):
    with pytest.raises(ConfigError, match=rf"^{name}"):
        SamplingConfig(**kwargs)


def test_defaults_and_derived_values():
    cfg = TreeConfig()
    assert (cfg.depth, cfg.frontier, cfg.slots, cfg.budget, cfg.rheostat, cfg.support) == (6, 8, 8, 48, 1, 128)
    assert cfg.effective_rheostat(SamplingConfig(temperature=0)) == cfg.slots
    assert cfg.effective_rheostat(SamplingConfig()) == 1
    assert cfg.capacity == 1 + 8 * (1 + 8 * 5) and cfg.max_expanded == 1 + 8 * 5
    assert SamplingConfig(temperature=0).greedy and SamplingConfig(temperature=0).draft_temperature == 1.0
    assert SamplingConfig(temperature=0.5).draft_temperature == 0.5
    assert cfg.as_dict()["proxy"] == "default"


def test_with_revalidates():
    assert TreeConfig().with_(rheostat=3).rheostat == 3
    with pytest.raises(ConfigError, match="rheostat"):
        TreeConfig().with_(rheostat=99)
    assert issubclass(ConfigError, ValueError)
