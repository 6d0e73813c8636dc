"""The embedded model: deterministic, a real checkpoint, loads fp32 and int8 through the public loader."""

from __future__ import annotations

import filecmp
import json

import pytest
from torch import nn

from service.model.loading import load_model
from service.native import float_ops
from service.quant.int8_linear import Int8Linear
from service.random_checkpoints.make import make_checkpoint
from service.random_checkpoints.presets import BUILT, PRESETS, model_config

from conftest import make_settings, run_cli


def test_checkpoint_creation_is_deterministic(tmp_path):
    a, b = make_checkpoint("tiny", tmp_path / "a"), make_checkpoint("tiny", tmp_path / "b")
    names = sorted(p.name for p in a.iterdir())
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "chat_template.jinja",
        "generation_config.json",
    } <= set(names)
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert mismatch == [] and errors == []


# The releases' parameter counts (docs/models.md says where they come from); 2B's from the 2B release.
PUBLISHED_PARAMETERS = {"2b": 2_127_532_032, "4b": 4_437_815_808, "8b": 8_767_123_696, "30b-a3b": 31_070_754_032}
# 30b-a3b-e32: 30B-A3B without 96 of each layer's 128 experts — each 3 × 2048 × 768 weights and its
# router row of 2048 — in its 48 layers.
PUBLISHED_PARAMETERS["30b-a3b-e32"] = PUBLISHED_PARAMETERS["30b-a3b"] - 48 * 96 * (3 * 2048 * 768 + 2048)


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMETERS))
def test_presets_have_the_releases_shapes(preset):
    """Each preset's config, built on the meta device (no memory): the release's parameter count to
    the last digit, its class, its tied or untied embedding."""
    import torch

    from service.quant.fusion import model_class

    config = model_config(preset)
    with torch.device("meta"):
        model = model_class(config)(config)
    assert sum(t.numel() for t in model.parameters()) == PUBLISHED_PARAMETERS[preset]
    tied = model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert tied == (preset in ("2b", "4b"))
    assert (config.model_type == "qwen3_vl_moe") == preset.startswith("30b-a3b")
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size
    if preset.startswith("30b-a3b"):
        experts = 32 if preset == "30b-a3b-e32" else 128
        text = config.text_config
        assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size) == (experts, 8, 768)
        assert (text.num_hidden_layers, text.num_key_value_heads, text.mlp_only_layers) == (48, 4, [])
        layer = model.model.language_model.layers[0].mlp.experts
        assert tuple(layer.gate_up_proj.shape) == (experts, 1536, 2048)
        assert tuple(layer.down_proj.shape) == (experts, 2048, 768)


def test_the_30b_preset_is_written_only_straight_into_the_quantized_formats(tmp_path):
    assert set(PRESETS) - set(BUILT) == {"30b-a3b", "qwen3.5-35b-a3b"}
    with pytest.raises(ValueError, match="--bits 4"):
        make_checkpoint("30b-a3b", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_tiny_moe_stores_its_experts_as_the_releases_do(tiny_moe_dir):
    """[experts, hidden, 2·width] and [experts, width, hidden]: the layout transformers converts at load."""
    from safetensors import safe_open

    config = json.loads((tiny_moe_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl_moe" and config["tie_word_embeddings"] is False
    with safe_open(tiny_moe_dir / "model.safetensors", "pt") as f:
        assert f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape() == [8, 64, 192]
        assert f.get_slice("model.language_model.layers.2.mlp.experts.down_proj").get_shape() == [8, 96, 64]
        assert "model.language_model.layers.1.mlp.gate_proj.weight" in f.keys()  # mlp_only_layers: dense


def test_embedded_model_is_marked_random_and_uses_real_qwen_token_layout(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl" and config["random_test_model"] is True
    vocab = json.loads((tiny_dir / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    assert config["image_token_id"] == ids["<|image_pad|>"]
    assert config["vision_start_token_id"] == ids["<|vision_start|>"]


def test_loads_fp32_and_int8_through_the_public_loader(loaded_model):
    fp32, int8 = loaded_model("fp32"), loaded_model("int8")  # the public loader's, as the engines have them
    assert fp32.is_random and int8.is_random
    assert isinstance(int8.model.model.language_model.layers[0].self_attn.qkv_proj, Int8Linear)
    assert isinstance(int8.model.lm_head, Int8Linear)
    assert isinstance(int8.model.model.visual.blocks[0].mlp.linear_fc1, Int8Linear)
    plain = [n for n, m in int8.model.named_modules() if type(m) is nn.Linear]
    assert plain == []  # every Linear, vision and text, is INT8
    assert isinstance(fp32.model.lm_head, float_ops.Linear)  # fp32: the fixed-order GEMM (the same bits on every CPU)


@pytest.mark.slow
def test_cli_chat_streams_an_answer_and_prints_timings(cache_dir, tiny_dir, tmp_path):
    from imaging import encode, pattern

    photo = tmp_path / "photo.jpg"
    photo.write_bytes(encode(pattern(640, 480), ".jpg"))
    result = run_cli(
        "chat", "--image", str(photo), "--image", str(photo), "What is in this picture?",
        "--max-tokens", "12", "--temperature", "0", "--cache-dir", str(cache_dir),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "RANDOM-WEIGHT" in result.stderr  # says loudly that the answer is noise
    for label in ("load", "image decode", "vision encode", "time to first token", "tok/s", "peak RSS"):
        assert label in result.stderr
    assert "12 new tokens" in result.stderr
    assert "INT8 kernels: decoder " in result.stderr  # which kernel the measurement chose, and its figures


@pytest.mark.slow
def test_cli_reports_bad_settings_readably(tmp_path):
    result = run_cli("chat", "hi", "--model-path", str(tmp_path / "nope"), timeout=60)
    assert result.returncode != 0
    assert "MODEL_PATH" in result.stderr and "is not a directory" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_cli_make_model_writes_a_checkpoint(tmp_path):
    result = run_cli("make-model", "--preset", "tiny", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "m" / "model.safetensors").exists()


@pytest.mark.slow
def test_cli_chat_answers_in_json_valid_against_a_schema_file(cache_dir, tiny_dir, tmp_path):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"animal": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
        "required": ["animal", "legs"],
        "additionalProperties": False,
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))

    def chat(*flags):
        return run_cli("chat", "Which animal?", "--cache-dir", str(cache_dir), *flags)

    result = chat("--json-schema", str(tmp_path / "schema.json"), "--temperature", "1", "--seed", "3")
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), schema)
    (tmp_path / "bad.json").write_text('{"type": "object", "properties": {"a": {"pattern": "(?<=x)"}}}')
    refused = chat("--json-schema", str(tmp_path / "bad.json"))
    assert refused.returncode == 2 and "cannot be enforced" in refused.stderr


def test_an_untied_dense_checkpoint_gets_its_own_embedding_table(cache_dir, tiny_dir, tmp_path):
    """As Qwen3-VL-8B: lm_head and the embedding are separate matrices. Quantized at load and as a
    checkpoint, the embedding is its own INT8 table (not lm_head's rows), and both give the same logits."""
    import shutil

    import torch
    from safetensors import safe_open
    from transformers import Qwen3VLForConditionalGeneration

    from service.model.attention import ExactAttention
    from service.model.forward import Rows, TextForward
    from service.quant.int8_linear import Int8Embedding, quantize_rows
    from service.quant.writer import write_quantized

    untied = tmp_path / "untied"
    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = model.config.text_config.tie_word_embeddings = False
    model.lm_head.weight = nn.Parameter(
        torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(1))
    )
    model.save_pretrained(untied)
    for file in tiny_dir.iterdir():
        if file.suffix != ".safetensors" and not (untied / file.name).exists():
            shutil.copy2(file, untied / file.name)
    with safe_open(untied / "model.safetensors", "pt") as f:
        table = f.get_tensor("model.language_model.embed_tokens.weight")
        assert not torch.equal(table, f.get_tensor("lm_head.weight"))
    again = Qwen3VLForConditionalGeneration.from_pretrained(untied, dtype=torch.float32)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)  # loads untied, as saved
    logits = []
    for path in (untied, write_quantized(untied, tmp_path / "untied-int8", progress=False)):
        loaded = load_model(make_settings(cache_dir, model_path=path, quantization="int8", int8_kernel="native"))
        embedding = loaded.model.model.language_model.embed_tokens
        assert isinstance(embedding, Int8Embedding)
        rows, scales = quantize_rows(table)
        assert torch.equal(embedding.rows, rows) and torch.equal(embedding.scales, scales)
        forward = TextForward(loaded.model, ExactAttention.load())
        logits.append(forward(torch.arange(40, 60), torch.arange(20), [Rows(forward.new_cache(torch.float32), 20)]))
    assert torch.equal(logits[0], logits[1])
