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


# --------------------------------------------------------------------------------------
# SamplingConfig: transformers' fields
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,needle", [
    (dict(min_p=-0.1), "min_p=-0.1 is out of range: allowed [0, 1]"),
    (dict(min_p=1.5), "min_p=1.5 is out of range"),
    (dict(typical_p=0.0), "typical_p=0.0 is out of range: allowed (0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0 is out of range: allowed (0, 100]"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty=nan"),
    (dict(min_p="0.1"), "min_p='0.1' is a str"),
])
def test_new_sampling_fields_are_checked(kw, needle):
    with pytest.raises(ConfigError) as err:
        SamplingConfig(**kw)
    assert needle in str(err.value)


def test_from_generation_config_maps_what_generate_uses():
    from transformers import GenerationConfig

    # do_sample left unset: generate is greedy; its global defaults fill the rest (top_k=50)
    assert SamplingConfig.from_generation_config(GenerationConfig()) == SamplingConfig(temperature=0, top_k=50)
    gc = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, typical_p=0.95,
                          repetition_penalty=1.1, max_new_tokens=64, eos_token_id=2, pad_token_id=0)
    assert SamplingConfig.from_generation_config(gc) == SamplingConfig(
        temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, typical_p=0.95, repetition_penalty=1.1)
    assert SamplingConfig.from_generation_config({"do_sample": True, "top_k": 0}) == SamplingConfig()


def test_from_generation_config_names_every_unsupported_field_that_is_set():
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=True, no_repeat_ngram_size=3, epsilon_cutoff=3e-4, num_beams=1,
                          suppress_tokens=[5], min_length=0)
    with pytest.raises(ConfigError) as err:
        SamplingConfig.from_generation_config(gc)
    msg = str(err.value)
    for part in ("no_repeat_ngram_size=3", "epsilon_cutoff=0.0003", "suppress_tokens=[5]", "logits_processors"):
        assert part in msg, msg
    for inactive in ("num_beams", "min_length"):  # set to values at which generate adds nothing
        assert inactive not in msg, msg
