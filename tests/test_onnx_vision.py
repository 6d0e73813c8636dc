"""The ONNX Runtime vision encoder on the real tiny model: the export command, equality with the
torch tower (fp32 exact, INT8 close), greedy answers, and the fallback to torch when the export is
missing or stale."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from service.cli import main
from service.engine.engine import Completion, Engine, GenerationRequest, SamplingParams
from service.media.images import decode_image
from service.model.loading import load_model
from service.model.prompts import ChatMessage, ImagePart, TextPart
from service.quant.writer import write_quantized
from service.vision.encoders import make_vision_encoder
from service.vision.features import TorchVisionEncoder
from service.vision.onnx import GRAPH_FILES, MANIFEST, OnnxVisionEncoder, default_export_dir

from conftest import make_settings, prepared
from imaging import encode, pattern

# A checkpoint written and loaded per module (~15 s): the whole suite only.
pytestmark = pytest.mark.slow

# Patch grids (h × w) 28×28, 20×36, 14×20 (small pictures are scaled up to the minimum) and 56×12.
IMAGE_SIZES = [(448, 448), (640, 360), (96, 64), (200, 900)]


@pytest.fixture(scope="module")
def checkpoint(tiny_dir, tmp_path_factory):
    """This module's own copy of the tiny checkpoint (a test changes a file's mtime)."""
    copy = tmp_path_factory.mktemp("onnx") / "tiny"
    shutil.copytree(tiny_dir, copy)
    return copy


@pytest.fixture(scope="module")
def export_dir(checkpoint, cache_dir):
    """Built by the CLI command into the cache directory the service looks in."""
    assert main(["--log-level", "WARNING", "export-onnx", str(checkpoint), "--cache-dir", str(cache_dir)]) == 0
    return default_export_dir(checkpoint, cache_dir)


def engine_for(checkpoint, cache_dir, **overrides) -> Engine:
    settings = make_settings(cache_dir, model_path=checkpoint, quantization="fp32", **overrides)
    return Engine(load_model(settings), settings)


@pytest.fixture(scope="module")
def torch_engine(checkpoint, cache_dir):
    return engine_for(checkpoint, cache_dir, vision_backend="torch")


@pytest.fixture(scope="module")
def onnx_engine(checkpoint, cache_dir, export_dir):
    return engine_for(checkpoint, cache_dir, vision_backend="onnxruntime")


def messages(engine, sizes, text="Describe the picture.") -> list[ChatMessage]:
    parts = [
        ImagePart(decode_image(encode(pattern(w, h, seed=i), ".png"), engine.limits.image))
        for i, (w, h) in enumerate(sizes)
    ]
    return [ChatMessage("user", [*parts, TextPart(text)])]


def prompt(engine, sizes):
    return prepared(engine, GenerationRequest(messages(engine, sizes)))


def outputs(features):
    return [t for f in features for t in (f.pooler, *f.deepstack)]


def relative_error(reference: torch.Tensor, other: torch.Tensor) -> float:
    return ((reference - other).abs().max() / reference.abs().max()).item()


def cosine(reference: torch.Tensor, other: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(reference.flatten(), other.flatten(), dim=0).item()


def test_export_command_writes_fp32_and_int8_graphs_named_after_the_checkpoint(export_dir, checkpoint):
    assert sorted(p.name for p in export_dir.iterdir()) == sorted(
        [MANIFEST, *GRAPH_FILES.values(), GRAPH_FILES["fp32"] + ".data"]
    )
    assert str(checkpoint) in (export_dir / MANIFEST).read_text()


def test_service_uses_the_export_when_the_setting_asks_for_it(onnx_engine, torch_engine):
    assert isinstance(onnx_engine.vision_encoder, OnnxVisionEncoder)
    assert onnx_engine.vision_encoder.precision == "fp32"
    assert isinstance(torch_engine.vision_encoder, TorchVisionEncoder)


@pytest.mark.parametrize("size", IMAGE_SIZES)
def test_fp32_graph_gives_the_torch_towers_features(onnx_engine, torch_engine, size):
    p = prompt(torch_engine, [size])
    expected = outputs(torch_engine.vision_encoder(p.pixel_values[0], p.image_grid_thw))
    got = outputs(onnx_engine.vision_encoder(p.pixel_values[0], p.image_grid_thw))
    assert len(got) == 1 + len(torch_engine.model.config.vision_config.deepstack_visual_indexes)
    for reference, other in zip(expected, got, strict=True):
        assert other.shape == reference.shape
        assert relative_error(reference, other) <= 1e-4


@pytest.mark.parametrize("size", IMAGE_SIZES)
def test_int8_setting_runs_the_int8_graph_close_to_the_torch_tower(onnx_engine, torch_engine, cache_dir, size):
    settings = make_settings(
        cache_dir, model_path=onnx_engine.loaded.path, quantization="int8", vision_backend="onnxruntime"
    )
    encoder = make_vision_encoder(onnx_engine.loaded, settings)
    assert encoder.precision == "int8"
    p = prompt(torch_engine, [size])
    expected = outputs(torch_engine.vision_encoder(p.pixel_values[0], p.image_grid_thw))
    got = outputs(encoder(p.pixel_values[0], p.image_grid_thw))
    for reference, other in zip(expected, got, strict=True):
        assert cosine(reference, other) >= 0.99
        assert relative_error(reference, other) > 1e-4  # really quantized, not the fp32 graph


def test_several_images_in_one_call_attend_only_within_each_image(onnx_engine, torch_engine):
    p = prompt(torch_engine, IMAGE_SIZES[:3])
    pixels = torch.cat(p.pixel_values)
    expected = torch_engine.vision_encoder(pixels, p.image_grid_thw)
    got = onnx_engine.vision_encoder(pixels, p.image_grid_thw)
    assert len(got) == 3
    for reference, other in zip(outputs(expected), outputs(got), strict=True):
        assert relative_error(reference, other) <= 1e-4


def test_video_frames_attend_only_within_each_frame(onnx_engine, torch_engine):
    grid = torch.tensor([[3, 8, 12]])
    patches = torch.randn(int(grid.prod()), 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0))
    expected = torch_engine.vision_encoder(patches, grid)
    got = onnx_engine.vision_encoder(patches, grid)
    for reference, other in zip(outputs(expected), outputs(got), strict=True):
        assert relative_error(reference, other) <= 1e-4


def greedy_answer(engine, sizes, text) -> str:
    request = GenerationRequest(messages(engine, sizes, text), SamplingParams(max_tokens=16, temperature=0))
    return [e for e in engine.generate(request) if isinstance(e, Completion)][0].text


def test_greedy_answers_equal_the_torch_paths_in_fp32(onnx_engine, torch_engine):
    cases = [([(448, 448)], "What is in this picture?"), ([(640, 360), (96, 64)], "Compare the two pictures.")]
    answers = [greedy_answer(torch_engine, sizes, text) for sizes, text in cases]
    assert answers[0] != answers[1]  # the images and words shape the answer, so equality below means something
    assert [greedy_answer(onnx_engine, sizes, text) for sizes, text in cases] == answers


def test_stale_export_falls_back_to_torch_with_a_warning(onnx_engine, checkpoint, caplog):
    weights = next(checkpoint.glob("*.safetensors"))
    before = weights.stat()
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # the checkpoint was rewritten
    try:
        with caplog.at_level(logging.WARNING, logger="service.vision.onnx"):
            encoder = make_vision_encoder(onnx_engine.loaded, onnx_engine.settings)
    finally:
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert isinstance(encoder, TorchVisionEncoder)
    assert "export-onnx" in caplog.text
    assert isinstance(make_vision_encoder(onnx_engine.loaded, onnx_engine.settings), OnnxVisionEncoder)


def test_missing_export_falls_back_to_torch_with_a_warning(onnx_engine, cache_dir, tmp_path, caplog):
    settings = make_settings(
        cache_dir, model_path=onnx_engine.loaded.path, vision_backend="onnxruntime", vision_onnx_dir=tmp_path
    )
    with caplog.at_level(logging.WARNING, logger="service.vision.onnx"):
        encoder = make_vision_encoder(onnx_engine.loaded, settings)
    assert isinstance(encoder, TorchVisionEncoder)
    assert f"no ONNX export in {tmp_path}" in caplog.text


def test_export_refuses_a_pre_quantized_checkpoint_saying_why(checkpoint, tmp_path, capsys):
    int8_dir = write_quantized(checkpoint, tmp_path / "int8", progress=False)
    assert main(["--log-level", "WARNING", "export-onnx", str(int8_dir), str(tmp_path / "out")]) == 2
    assert "pre-quantized INT8 checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_default_backend_is_torch_even_with_an_export(onnx_engine, cache_dir):
    """ONNX Runtime INT8 encodes faster but costs memory and batching smoothness (README): torch stays the default."""
    settings = make_settings(cache_dir, model_path=onnx_engine.loaded.path)
    assert settings.vision_backend == "torch"
    assert isinstance(make_vision_encoder(onnx_engine.loaded, settings), TorchVisionEncoder)


def test_a_mixture_of_experts_tower_exports_alone_and_gives_the_torch_towers_features(
    tiny_moe_dir, cache_dir, tmp_path
):
    """tiny-moe's tower (Qwen3-VL-MoE's class) is exported from its own tensors — the decoder never
    loaded — and its fp32 graph computes what the torch tower computes."""
    checkpoint = tmp_path / "tiny-moe"
    shutil.copytree(tiny_moe_dir, checkpoint)
    assert main(["--log-level", "WARNING", "export-onnx", str(checkpoint), "--cache-dir", str(cache_dir)]) == 0
    torch_engine = engine_for(checkpoint, cache_dir, vision_backend="torch")
    onnx_engine = engine_for(checkpoint, cache_dir, vision_backend="onnxruntime")
    assert isinstance(onnx_engine.vision_encoder, OnnxVisionEncoder)
    p = prompt(torch_engine, [(640, 360)])
    expected = outputs(torch_engine.vision_encoder(p.pixel_values[0], p.image_grid_thw))
    got = outputs(onnx_engine.vision_encoder(p.pixel_values[0], p.image_grid_thw))
    for reference, other in zip(expected, got, strict=True):
        assert relative_error(reference, other) <= 1e-4
