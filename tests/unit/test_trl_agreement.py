"""Collage's loss and algorithm options agree with TRL's configs (TRL is a dev extra only; ``training/`` never imports
it): every key has TRL's name and default, a key of one algorithm is refused for the other as TRL refuses it,
settings TRL warns about give a warning event naming the key, and the launch form shows each with TRL's name."""

from __future__ import annotations

import dataclasses

import pytest

from collage.training import algorithms as alg

# --------------------------------------------------------------------------------------- option surface
# The loss/algorithm keys whose names, defaults and meaning come from TRL (the rest of ``train`` are run settings
# with Collage's own small-run defaults, or keys TRL leaves to transformers' TrainingArguments).
TRL_OPTIONS = (
    "beta",
    "use_bias_correction_kl",
    "epsilon",
    "epsilon_high",
    "delta",
    "loss_type",
    "importance_sampling_level",
    "sapo_temperature_neg",
    "sapo_temperature_pos",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "multi_objective_aggregation",
    "scale_rewards",
    "normalize_advantages",
    "top_entropy_quantile",
    "entropy_coef",
    "sync_ref_model",
    "ref_model_mixup_alpha",
    "ref_model_sync_steps",
    "num_iterations",
    "steps_per_generation",
    "mask_truncated_completions",
    "temperature",
)


def test_option_names_defaults_and_algorithms_are_trls():
    from trl import GRPOConfig, RLOOConfig

    from collage.app.web.fields import HELP, form_fields
    from collage.training.config import GRPO_ONLY, RLOO_ONLY, ConfigError, TrainSettings, parse_config

    trl_fields = {
        "grpo": {f.name: f.default for f in dataclasses.fields(GRPOConfig)},
        "rloo": {f.name: f.default for f in dataclasses.fields(RLOOConfig)},
    }
    assert set(TRL_OPTIONS) <= set(TrainSettings.model_fields)
    for algorithm, fields in trl_fields.items():
        resolved = parse_config({"algorithm": algorithm}).train
        only_other = RLOO_ONLY if algorithm == "grpo" else GRPO_ONLY
        for key in TRL_OPTIONS:
            if key in fields:
                assert getattr(resolved, key) == fields[key], (algorithm, key, getattr(resolved, key), fields[key])
                assert key not in only_other, (algorithm, key)
            else:
                assert key in only_other, f"train.{key} is not in TRL's {algorithm} config: it must be refused there"
    assert parse_config({"algorithm": "rloo"}).train.beta == 0.05 and parse_config({}).train.beta == 0.0
    for loss_type in alg.LOSS_TYPES:
        assert f"'{loss_type}'" in GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    assert set(alg.LOSS_TYPES) == set(TrainSettings.model_fields["loss_type"].annotation.__args__)

    # a non-default value of the other algorithm's key is refused, naming the key; TRL's own refusals too
    refused = {
        ("rloo", "loss_type", "sapo"),
        ("rloo", "importance_sampling_level", "sequence"),
        ("rloo", "top_entropy_quantile", 0.2),
        ("rloo", "entropy_coef", 0.01),
        ("rloo", "delta", 2.0),
        ("rloo", "multi_objective_aggregation", "normalize_then_sum"),
        ("grpo", "normalize_advantages", True),
    }
    for algorithm, key, value in refused:
        with pytest.raises(ConfigError) as err:
            parse_config({"algorithm": algorithm, "train": {key: value}})
        assert err.value.errors == [(f"train.{key}", f"does not apply to algorithm {algorithm}")]
    with pytest.raises(ConfigError) as err:
        parse_config({"train": {"sync_ref_model": True}})  # GRPO's beta defaults to 0: no reference
    assert err.value.errors[0][0] == "train.sync_ref_model" and "beta > 0" in err.value.errors[0][1]
    with pytest.raises(ConfigError) as err:
        parse_config({"algorithm": "rloo", "model": {"lora": {"r": 4}}, "train": {"sync_ref_model": True}})
    assert err.value.errors[0][0] == "train.sync_ref_model" and "lora" in err.value.errors[0][1]
    assert parse_config({"algorithm": "rloo", "train": {"sync_ref_model": True}}).train.sync_ref_model

    # settings TRL accepts with a logged warning are accepted here too, with a warning event naming the key
    from collage.training.trainer import option_warnings

    warned = {
        ("luspo", "token"): "train.loss_type",
        ("vespo", "sequence"): "train.importance_sampling_level",
        ("dapo", "sequence"): "train.importance_sampling_level",
        ("cispo", "token"): "train.epsilon_high",
    }
    for (loss_type, level), key in warned.items():
        messages = option_warnings(
            parse_config({"train": {"loss_type": loss_type, "importance_sampling_level": level}})
        )
        assert len(messages) == 1 and messages[0].startswith(key + ": "), (loss_type, level, messages)
    quiet = [{"loss_type": "luspo", "importance_sampling_level": "sequence"}, {"loss_type": "grpo"}, {}]
    assert all(option_warnings(parse_config({"train": train})) == [] for train in quiet)
    assert option_warnings(parse_config({"train": {"loss_type": "sapo", "delta": 2.0}}))[0].startswith("train.delta")

    # the launch form shows each option with TRL's name, only for the algorithm that has it
    fields = {f.path: f for f in form_fields()}
    for key in TRL_OPTIONS:
        path = f"train.{key}"
        assert path in HELP and f"TRL: {key}" in HELP[path][0], path
        expected = "grpo" if key in GRPO_ONLY else "rloo" if key in RLOO_ONLY else None
        assert fields[path].algorithm == expected, path
