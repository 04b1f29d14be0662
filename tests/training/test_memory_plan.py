"""The memory plan before launch (``collage plan``): exact parameter counts of real models from their config.json
alone (written here from their published values: no weights, no hub), and the formula's parts per strategy."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml

from collage.training.config import parse_config
from collage.training.memory_plan import ModelShape, RunShape, figures, make_plan, parse_size

QWEN25_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "max_position_embeddings": 128000, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", "image_token_id": 151655,
    "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
}  # fmt: skip
QWEN25_VL_3B = {
    **QWEN25_VL_7B, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
    "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    "vision_config": {**QWEN25_VL_7B["vision_config"], "out_hidden_size": 2048},
}  # fmt: skip
IDEFICS3_8B = {
    "architectures": ["Idefics3ForConditionalGeneration"], "model_type": "idefics3", "image_token_id": 128257,
    "scale_factor": 2, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "text_config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128259,
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                    "tie_word_embeddings": False, "pad_token_id": 128002},
    "vision_config": {"model_type": "idefics3_vision", "hidden_size": 1152, "intermediate_size": 4304,
                      "num_hidden_layers": 27, "num_attention_heads": 16, "patch_size": 14, "image_size": 364},
}  # fmt: skip
# the parameter counts their model cards publish (safetensors metadata), in billions, to the digits shown
PUBLISHED = {"qwen2.5-vl-3b": (QWEN25_VL_3B, 3.75), "qwen2.5-vl-7b": (QWEN25_VL_7B, 8.29),
             "idefics3-8b": (IDEFICS3_8B, 8.46)}  # fmt: skip


def model_folder(tmp_path, config: dict):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_of_real_models_from_their_config_alone(tmp_path, name):
    config, billions = PUBLISHED[name]
    run = parse_config({"model": {"path": str(model_folder(tmp_path, config)), "dtype": "bfloat16"},
                        "train": {"beta": 0.04}, "resources": {"gpus": 8}})  # fmt: skip
    plan = make_plan(run, gpu_memory=parse_size("80GiB"))
    shape = plan.model
    assert abs(shape.parameters / 1e9 - billions) < 0.006, shape.parameters  # within the published rounding
    assert shape.trainable == shape.parameters - shape.vision_parameters  # freeze_vision (the default)
    assert shape.dtype_bytes == 2 and shape.layers == (config.get("text_config") or config)["num_hidden_layers"]
    ddp, fsdp, offload = plan.strategies
    assert [f.strategy for f in plan.strategies] == ["ddp", "fsdp", "fsdp+offload"]
    # a 7-8B model with a reference and AdamW does not fit one 80 GiB GPU under DDP, and does sharded over 8
    if billions > 8:
        assert not plan.fits(ddp) and plan.fits(fsdp) and plan.fits(offload)
    assert offload.peak < fsdp.peak < ddp.peak


def shape(**changes) -> ModelShape:
    base = ModelShape("m", parameters=1000, trainable=800, vision_parameters=200, largest_layer=50, layers=4,
                      hidden=16, intermediate=64, kv_width=8, vocab=100, dtype_bytes=2)  # fmt: skip
    return replace(base, **changes)


RUN = RunShape(processes=4, micro_batch=2, sequence=10, rollouts_per_process=8, beta=0.1, lora=False,
               gradient_checkpointing=False)  # fmt: skip


def test_the_formula_part_by_part():
    m = shape()
    ddp = figures(m, RUN, "ddp")
    assert (ddp.parameters, ddp.gradients, ddp.optimizer, ddp.reference) == (2000, 1600, 3200, 2000)
    per_layer = (6 * 16 + 2 * 8 + 4 * 64) * 2
    assert ddp.activations == 2 * 10 * 4 * per_layer
    assert ddp.logits == 20 * 100 * 4 * 3  # fewer tokens than a chunk: the whole micro-batch at once
    assert ddp.generation_cache == 2 * 4 * 8 * 2 * 8 * 10
    assert ddp.training_peak == 2000 + 1600 + 3200 + 2000 + ddp.activations + ddp.logits
    assert ddp.peak == max(ddp.training_peak, ddp.generation_peak) and ddp.gathered == ddp.generation_weights == 0
    fsdp = figures(m, RUN, "fsdp")
    assert (fsdp.parameters, fsdp.gradients, fsdp.optimizer, fsdp.reference) == (500, 400, 800, 500)
    assert fsdp.gathered == 2 * 50 * 2 and fsdp.generation_weights == 2000 - 500  # the whole policy to generate
    offload = figures(m, RUN, "fsdp+offload")
    assert offload.parameters == offload.optimizer == 0 and offload.host == 500 + 400 + 800 + 500
    assert offload.generation_weights == 2000


def test_lora_needs_no_reference_and_checkpointing_keeps_one_layer():
    lora = figures(shape(trainable=10), replace(RUN, lora=True), "ddp")
    assert lora.reference == 0 and lora.gradients == 20 and lora.optimizer == 40
    ckpt = figures(shape(), replace(RUN, gradient_checkpointing=True), "ddp")
    per_layer = (6 * 16 + 2 * 8 + 4 * 64) * 2
    assert ckpt.activations == 2 * 10 * (4 * 16 * 2 + per_layer) < figures(shape(), RUN, "ddp").activations
    assert figures(shape(), replace(RUN, beta=0.0), "ddp").reference == 0


def test_sizes():
    assert parse_size("80GiB") == 80 * 1024**3 and parse_size("141 GB") == 141 * 10**9 and parse_size("24") == 24 << 30
    with pytest.raises(ValueError, match="unknown size unit"):
        parse_size("8XB")


def test_collage_plan_on_the_command_line(tmp_path, capsys):
    from collage.app.cli.main import main

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(model_folder(tmp_path, QWEN25_VL_7B)), "dtype": "bfloat16"},
                                      "train": {"beta": 0.04}}))  # fmt: skip
    assert main(["plan", str(config), "--gpus", "8", "--gpu-memory", "80GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["run"]["processes"] == 8 and [s["fits"] for s in plan["strategies"]] == [False, True, True]
    assert main(["plan", str(config), "--gpus", "8", "--gpu-memory", "80GiB"]) == 0
    text = capsys.readouterr().out
    assert "ddp: peak" in text and "DOES NOT FIT in 80.00 GiB" in text
    assert main(["plan", str(config), "--gpu-memory", "lots"]) == 2
    assert "--gpu-memory" in capsys.readouterr().err
