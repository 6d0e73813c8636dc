"""The embedded model: deterministic, a real checkpoint, loads fp32 and int8 through the public loader."""

from __future__ import annotations

import filecmp
import json

import pytest
from torch import nn

from service.model.checkpoints import make_checkpoint
from service.quant.int8_linear import Int8Linear

from conftest import run_cli


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
    assert type(fp32.model.lm_head) is nn.Linear


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
