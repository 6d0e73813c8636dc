"""Pre-quantized INT8 checkpoints on the real tiny model: the quantize command, what it writes, and
that loading it answers exactly like quantizing at load time."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from service.engine.engine import Completion, Engine, GenerationRequest, SamplingParams
from service.media.images import decode_image
from service.model.loading import load_model
from service.model.prompts import ChatMessage, ImagePart, TextPart
from service.quant.int8_linear import Int8Embedding, Int8Linear
from service.quant.quantized import FORMAT, QUANTIZED_MARKER, write_quantized

from conftest import make_settings, run_cli
from imaging import encode, pattern

# A checkpoint written and loaded per module (~15 s): the whole suite only.
pytestmark = pytest.mark.slow

PROMPTS = ["Describe the colors.", "What is in this picture?", "Tell me a story about a red square."]


@pytest.fixture(scope="module")
def int8_dir(tiny_dir, tmp_path_factory):
    """The tiny checkpoint quantized by the command a user runs."""
    dst = tmp_path_factory.mktemp("int8") / "tiny-int8"
    run = run_cli("quantize", str(tiny_dir), str(dst), timeout=300)
    assert run.returncode == 0, run.stderr
    assert "quantizing" in run.stderr and "100%" in run.stderr  # the tqdm progress bar (bytes read)
    assert f"MODEL_PATH={dst}" in run.stdout
    return dst


@pytest.fixture(scope="module")
def prequantized_engine(cache_dir, int8_dir) -> Engine:
    settings = make_settings(cache_dir, model_path=int8_dir)
    return Engine(load_model(settings), settings)


@pytest.fixture(scope="module")
def load_time_engine(cache_dir, loaded_model) -> Engine:
    return Engine(loaded_model("int8"), make_settings(cache_dir, quantization="int8", cache_enabled=False))


def greedy(engine: Engine, text: str, with_image: bool) -> Completion:
    parts = [TextPart(text)]
    if with_image:
        img = decode_image(encode(pattern(448, 320, seed=len(text)), ".png"), engine.limits.image)
        parts.insert(0, ImagePart(img))
    events = list(
        engine.generate(GenerationRequest([ChatMessage("user", parts)], SamplingParams(max_tokens=24, temperature=0)))
    )
    return events[-1]


def first_logits(model, tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt").input_ids
    model.model.rope_deltas = None
    with torch.inference_mode():
        return model(input_ids=ids).logits[0]


def test_quantized_checkpoint_holds_int8_weights_per_channel_scales_and_the_loader_files(int8_dir, tiny_dir):
    marker = json.loads((int8_dir / "config.json").read_text())[QUANTIZED_MARKER]
    assert marker["format"] == FORMAT and "per output channel" in marker["weights"]
    assert marker["source"] == str(tiny_dir.resolve())
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        "generation_config.json",
    ):
        assert (int8_dir / name).read_bytes() == (tiny_dir / name).read_bytes()
    with safe_open(int8_dir / marker["linear_shards"][0], "pt") as f:
        weight = f.get_tensor("model.language_model.layers.0.mlp.down_proj.weight")
        scales = f.get_tensor("model.language_model.layers.0.mlp.down_proj.weight_scale")
    assert weight.dtype == torch.int8 and scales.dtype == torch.float32
    assert scales.shape == (weight.shape[0],)  # one scale per output channel
    assert len(set(scales.tolist())) > 1
    with safe_open(int8_dir / marker["resident"], "pt") as f:
        assert f.get_tensor("model.language_model.embed_tokens.weight").dtype == torch.int8
        assert all(f.get_tensor(k).dtype in (torch.int8, torch.float32) for k in f.keys())


def test_loading_builds_per_token_int8_modules_and_no_float_linear(prequantized_engine):
    loaded = prequantized_engine.loaded
    assert loaded.prequantized and not loaded.weights_mapped and loaded.quantization == "int8"
    modules = list(loaded.model.modules())
    assert not any(type(m) is nn.Linear for m in modules)
    int8 = [m for m in modules if isinstance(m, Int8Linear)]
    assert len(int8) > 20 and all(m.activations == "per_token" for m in int8)
    assert isinstance(loaded.model.get_input_embeddings(), Int8Embedding)


@pytest.mark.parametrize("with_image", [True, False])
def test_prequantized_checkpoint_answers_exactly_like_quantizing_at_load(
    prequantized_engine, load_time_engine, with_image
):
    for text in PROMPTS:
        a, b = greedy(prequantized_engine, text, with_image), greedy(load_time_engine, text, with_image)
        assert a.completion_tokens == b.completion_tokens == 24
        assert a.text == b.text


def test_prequantized_logits_are_bit_identical_to_quantize_at_load(prequantized_engine, load_time_engine):
    tok = load_time_engine.processor.tokenizer
    for text in PROMPTS:
        a = first_logits(prequantized_engine.model, tok, text)
        b = first_logits(load_time_engine.model, tok, text)
        assert torch.equal(a, b)


def test_int8_logits_stay_close_to_fp32(load_time_engine, fp32_engine):
    tok = fp32_engine.processor.tokenizer
    for text in PROMPTS:
        q, f = first_logits(load_time_engine.model, tok, text), first_logits(fp32_engine.model, tok, text)
        assert torch.nn.functional.cosine_similarity(q, f, dim=-1).min() > 0.98
        assert not torch.equal(q, f)


def test_fp32_setting_on_an_int8_checkpoint_is_refused_with_the_way_out(cache_dir, int8_dir):
    with pytest.raises(ValueError, match="quantized checkpoint.*QUANTIZATION=int8"):
        load_model(make_settings(cache_dir, model_path=int8_dir, quantization="fp32"))


def test_quantize_refuses_a_non_empty_destination_and_an_int8_source(tiny_dir, int8_dir, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        write_quantized(tiny_dir, tmp_path, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    with pytest.raises(ValueError, match="already a checkpoint written by `python -m service quantize`"):
        write_quantized(int8_dir, tmp_path / "again", progress=False)


def test_gunicorn_packs_a_prequantized_checkpoint_while_importing_and_answers_alike(
    serve, int8_dir, prequantized_engine
):
    """wsgi.py starts packing the int8 weights before the app (and transformers) is imported; the
    served answer is the one the loader gives."""
    import requests

    expected = greedy(prequantized_engine, PROMPTS[1], with_image=False)
    with serve({"MODEL_PATH": str(int8_dir), "PRELOAD": "true"}, "prequantized") as (base, _):
        reply = requests.post(
            base + "/v1/chat",
            json={"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0, "stream": False},
            timeout=60,
        ).json()
    assert reply["text"] == expected.text and reply["usage"]["completion_tokens"] == 24
    log = serve.log("prequantized").read_text()
    assert "pre-quantized" in log and "begun before the app was imported" in log


def test_packing_begun_before_loading_is_used_even_if_the_budget_now_looks_full(int8_dir):
    """wsgi.py begins packing when the weights fit; by the time the loader runs, their memory counts
    as used, so the loader must not decide again (it once mapped the weights it had just packed)."""
    from service.memory import MemoryGuard
    from service.quant import packing
    from service.quant.kernel_choice import KernelChoice
    from service.quant.quantized import load_quantized, quantized_marker

    kernel = KernelChoice(decoder="fbgemm", vision="onednn")
    packing.start(int8_dir, quantized_marker(int8_dir)["linear_shards"], 2, kernel)
    full = MemoryGuard(MemoryGuard(None).used_bytes() + 1)  # nothing more fits now
    model, mapped = load_quantized(int8_dir, 2, full, kernel)
    assert not mapped and packing.claim(int8_dir, kernel) is None  # the loader took the started packing
    assert any(isinstance(m, Int8Linear) for m in model.modules())
