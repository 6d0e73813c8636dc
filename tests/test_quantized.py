"""Pre-quantized INT8 checkpoints on the real tiny model: the quantize command, what it writes, and
that loading it answers exactly like quantizing at load time."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from torch import nn

from service.engine.engine import Completion, Engine, GenerationRequest, SamplingParams
from service.media.images import decode_image
from service.model.loading import load_model, warm_up
from service.model.prompts import ChatMessage, ImagePart, TextPart
from service.quant import int8_linear
from service.quant.int8_linear import Int8Linear, PackedInt8Embedding, pack_native, quantize_rows, unpack_native
from service.quant.kernel_choice import KernelChoice
from service.quant.packing import FORMAT, QUANTIZED_MARKER, native_int8_names
from service.quant.writer import write_quantized

from conftest import in_a_mapping_of, make_settings, run_cli
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
    assert marker["version"] == 2 and "native" in marker["int8_layout"]
    with safe_open(int8_dir / marker["linear_shards"][0], "pt") as f:
        names = native_int8_names(f.keys())
        down = "model.language_model.layers.0.mlp.down_proj"
        packed, scales = f.get_tensor(f"{down}.packed"), f.get_tensor(f"{down}.weight_scale")
        out_features, in_features = f.get_tensor(f"{down}.packed_shape").tolist()
        sums = f.get_tensor(f"{down}.column_sums")
    # q/k/v and gate/up stored fused, as the kernels compute them
    assert "model.language_model.layers.0.self_attn.qkv_proj" in names
    assert "model.language_model.layers.0.mlp.gate_up_proj" in names
    assert not any(n.endswith(("q_proj", "gate_proj")) for n in names)
    assert packed.dtype == torch.int8 and scales.dtype == torch.float32
    assert scales.shape == (out_features,) and len(set(scales.tolist())) > 1  # one scale per output channel
    with safe_open(tiny_dir / "model.safetensors", "pt") as f:
        source = f.get_tensor(f"{down}.weight")
    rows, want_scales = quantize_rows(source)
    assert torch.equal(unpack_native(packed, out_features, in_features), rows) and torch.equal(scales, want_scales)
    assert torch.equal(sums, rows.sum(1, dtype=torch.int32))
    with safe_open(int8_dir / marker["resident"], "pt") as f:
        # tied: the embedding is the INT8 lm_head's packed rows, not stored twice
        assert "model.language_model.embed_tokens.weight" not in f.keys()
        assert all(f.get_tensor(k).dtype in (torch.int8, torch.float32) for k in f.keys())


def test_the_native_layout_is_what_the_kernel_packs_on_any_cpu():
    """The layout written by torch (any machine) is the kernel's own `int8_pack`, padding included."""
    lib = int8_linear.native_library()
    for n, k in ((64, 128), (100, 70), (7, 3), (192, 2048)):
        rows = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        packed, sums = pack_native(rows)
        theirs = torch.empty(lib.int8_packed_bytes(n, k), dtype=torch.int8)
        their_sums = torch.empty(n, dtype=torch.int32)
        lib.int8_pack(rows.data_ptr(), n, k, theirs.data_ptr(), their_sums.data_ptr())
        assert torch.equal(packed, theirs) and torch.equal(sums, their_sums)
        assert torch.equal(unpack_native(packed, n, k), rows)


def test_loading_builds_per_token_int8_modules_and_no_float_linear(prequantized_engine):
    loaded = prequantized_engine.loaded
    assert loaded.prequantized and not loaded.weights_mapped and loaded.quantization == "int8"
    modules = list(loaded.model.modules())
    assert not any(type(m) is nn.Linear for m in modules)
    int8 = [m for m in modules if isinstance(m, Int8Linear)]
    assert len(int8) > 20 and all(m.activations == "per_token" for m in int8)
    assert isinstance(loaded.model.get_input_embeddings(), PackedInt8Embedding)  # tied: the lm_head's rows
    native = [m for m in int8 if m.kernel == "native"]
    # the native kernel computes on the checkpoint's own bytes: views of its mapped files, nothing copied
    assert all(in_a_mapping_of(m._packed.data_ptr(), loaded.path) for m in native)
    assert all(not in_a_mapping_of(m._packed.data_ptr(), loaded.path) for m in int8 if m.kernel != "native")


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


def vision_features(loaded):
    images = [pattern(224, 160, seed=5)]
    out = loaded.processor.image_processor(images, return_tensors="pt")
    with torch.inference_mode():
        [features] = loaded.model.model.visual.image_features(out["pixel_values"], out["image_grid_thw"])
    return features


def test_a_measured_packed_kernel_is_packed_after_the_start_with_the_same_bits(cache_dir, int8_dir, monkeypatch):
    """A probe that picks oneDNN for the vision tower (as on the 8B shapes here: 1.5x native's prefill)
    costs the start nothing: the native kernel serves the tower from the mapping until warm_up has
    packed oneDNN's layouts, the same bits before and after; a forced kernel is packed at load."""
    measured = KernelChoice(decoder="native", vision="onednn")
    monkeypatch.setattr("service.model.loading.int8_kernels", lambda settings, path: measured)
    loaded = load_model(make_settings(cache_dir, model_path=int8_dir))

    def tower_kernels():
        return {
            m.kernel
            for n, m in loaded.model.named_modules()
            if n.startswith("model.visual.") and isinstance(m, Int8Linear)
        }

    assert tower_kernels() == {"native"} and len(loaded.pending_packing) > 10
    before = vision_features(loaded)
    warm_up(loaded).join(60)
    assert tower_kernels() == {"onednn"} and not loaded.pending_packing
    after = vision_features(loaded)
    assert torch.equal(before.pooler, after.pooler)
    assert all(torch.equal(a, b) for a, b in zip(before.deepstack, after.deepstack))
    assert warm_up(loaded) is None  # packed once

    forced = KernelChoice(decoder="native", vision="onednn", forced=True)
    monkeypatch.setattr("service.model.loading.int8_kernels", lambda settings, path: forced)
    loaded = load_model(make_settings(cache_dir, model_path=int8_dir))
    assert tower_kernels() == {"onednn"} and not loaded.pending_packing


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


def test_gunicorn_serves_a_prequantized_checkpoint_alike_and_says_where_its_start_went(
    serve, int8_dir, prequantized_engine
):
    """The served answer is the one the loader gives; the log and /ready show the start's timeline."""
    import requests

    expected = greedy(prequantized_engine, PROMPTS[1], with_image=False)
    with serve({"MODEL_PATH": str(int8_dir), "PRELOAD": "true"}, "prequantized") as (base, _):
        reply = requests.post(
            base + "/v1/chat",
            json={"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0, "stream": False},
            timeout=60,
        ).json()
        ready = requests.get(base + "/ready", timeout=10).json()
    assert reply["text"] == expected.text and reply["usage"]["completion_tokens"] == 24
    phases = [step["phase"] for step in ready["startup"]]
    assert phases == ["imports", "processor", "weights", "engine", "worker"]
    assert all(step["seconds"] >= 0 for step in ready["startup"])
    at = [step["at"] for step in ready["startup"]]
    assert at == sorted(at) and at[-1] < 120
    log = serve.log("prequantized").read_text()
    assert "pre-quantized" in log and "model ready" in log and "after the process started: imports" in log


def format_1_copy(src, dst):
    """`src` (format 2) as the service wrote quantized checkpoints before: int8 rows of the checkpoint's
    own Linears (q/k/v, gate/up apart), packed at every start."""
    from transformers import AutoConfig

    from service.quant.packing import write_aligned_safetensors

    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    marker = config[QUANTIZED_MARKER]
    text = AutoConfig.from_pretrained(src).text_config
    head = text.head_dim
    splits = {
        "self_attn.qkv_proj": (
            ["q_proj", "k_proj", "v_proj"],
            [text.num_attention_heads * head] + [text.num_key_value_heads * head] * 2,
        ),
        "mlp.gate_up_proj": (["gate_proj", "up_proj"], [text.intermediate_size] * 2),
    }
    tensors = {}
    for shard in marker["linear_shards"]:
        with safe_open(src / shard, "pt") as f:
            for name in native_int8_names(f.keys()):
                n, k = f.get_tensor(f"{name}.packed_shape").tolist()
                rows, scales = unpack_native(f.get_tensor(f"{name}.packed"), n, k), f.get_tensor(f"{name}.weight_scale")
                fused = next((key for key in splits if name.endswith(key)), None)
                bias = f.get_tensor(f"{name}.bias") if f"{name}.bias" in f.keys() else None
                if fused is None:
                    tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = rows, scales
                    if bias is not None:
                        tensors[f"{name}.bias"] = bias
                    continue
                parts, sizes = splits[fused]
                prefix = name[: -len(fused)] + fused.split(".")[0] + "."
                for i, (part, r, sc) in enumerate(zip(parts, rows.split(sizes), scales.split(sizes))):
                    tensors[f"{prefix}{part}.weight"], tensors[f"{prefix}{part}.weight_scale"] = r.clone(), sc.clone()
                    if bias is not None:
                        tensors[f"{prefix}{part}.bias"] = bias.split(sizes)[i].clone()
    write_aligned_safetensors(tensors, dst / "int8-00001.safetensors")
    for file in src.iterdir():
        if file.name != "config.json" and not file.name.startswith("int8-"):
            shutil.copyfile(file, dst / file.name)
    marker.update(version=1, linear_shards=["int8-00001.safetensors"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_format_1_checkpoint_is_converted_once_into_the_cache_and_answers_alike(
    cache_dir, int8_dir, prequantized_engine, tmp_path, caplog
):
    old = format_1_copy(int8_dir, tmp_path / "tiny-int8-format-1")
    with caplog.at_level(logging.WARNING):
        loaded = load_model(make_settings(cache_dir, model_path=old))
    assert "format-1 quantized checkpoint: converting it to format 2" in caplog.text
    assert loaded.path.parent == cache_dir / "converted" and loaded.path.name.startswith(old.name)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = load_model(make_settings(cache_dir, model_path=old))
    assert again.path == loaded.path and "converting" not in caplog.text  # once
    tok = prequantized_engine.processor.tokenizer
    for text in PROMPTS:
        assert torch.equal(first_logits(loaded.model, tok, text), first_logits(prequantized_engine.model, tok, text))


PSS_PROBE = """
import sys, time, torch
from service.model.loading import load_model, warm_up
from service.settings import load_settings
loaded = load_model(load_settings())
ids = loaded.processor.tokenizer("Tell me a story.", return_tensors="pt").input_ids
loaded.model(input_ids=ids)  # every weight read once
print("ready", flush=True)
sys.stdin.readline()
"""


def mapped_memory(pid: int, directory) -> tuple[int, int]:
    """(Rss, Pss) in kB of process `pid`'s mappings of files under `directory`."""
    rss = pss = 0
    current = None
    for line in open(f"/proc/{pid}/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
            current = fields[5] if len(fields) >= 6 else ""
        elif current and current.startswith(str(directory)) and fields[0] in ("Rss:", "Pss:"):
            if fields[0] == "Rss:":
                rss += int(fields[1])
            else:
                pss += int(fields[1])
    return rss, pss


def test_two_processes_share_one_copy_of_the_mapped_weights(cache_dir, int8_dir):
    """Two servers' processes on one checkpoint: its weights are the page cache's pages, each
    process's proportional share (PSS) half of what it maps."""
    env = {**os.environ, "CACHE_DIR": str(cache_dir), "MODEL_PATH": str(int8_dir), "THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PSS_PROBE], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        shares = [mapped_memory(p.pid, int8_dir) for p in procs]
    finally:
        for p in procs:
            p.communicate("\n", timeout=60)
    total = sum((int8_dir / f).stat().st_size for f in os.listdir(int8_dir) if f.endswith(".safetensors")) // 1024
    for rss, pss in shares:
        assert rss > 0.3 * total  # the weights are mapped and were read (the text decoder's at least)
        assert pss < 0.6 * rss  # ... and shared: one copy for both
