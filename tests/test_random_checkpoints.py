"""`make-model --bits 4|8`: random weights written straight into the quantized formats, tensor by
tensor — the same tensors as `make-model` then `quantize`, in memory bounded by a tensor, not the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from service.quant.estimates import estimated_bytes
from service.quant.packing import QUANTIZED_MARKER
from service.quant.writer import write_quantized
from service.random_checkpoints import random_weights
from service.random_checkpoints.make import make_checkpoint
from service.random_checkpoints.presets import model_config

from conftest import ROOT, make_settings

# The marker's fields that say how and when a checkpoint was made (not what it holds).
PROVENANCE = ("made_by", "source", "created")


def _tensors(path: Path) -> dict[tuple[str, str], torch.Tensor]:
    return {(f.name, n): t for f in sorted(path.glob("*.safetensors")) for n, t in load_file(f).items()}


def _config(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    for field in PROVENANCE:
        config[QUANTIZED_MARKER].pop(field)
    return config


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    unequal = [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    assert unequal == []
    assert _config(a) == _config(b)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        if not name.endswith(".safetensors") and name != "config.json":
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize(
    "preset, bits, per_tensor",
    [
        ("tiny-moe", 4, None),  # experts, a dense layer, an untied embedding: seeded per tensor
        ("tiny-moe", 8, None),
        ("tiny", 4, True),  # dense with a tied embedding, through the per-tensor generator
        ("tiny", 4, None),  # the embedded model, whose whole-model initialisation is kept
    ],
)
def test_make_model_bits_writes_what_make_model_then_quantize_writes(tmp_path, preset, bits, per_tensor):
    direct = make_checkpoint(preset, tmp_path / "direct", bits=bits, per_tensor_seeds=per_tensor)
    plain = make_checkpoint(preset, tmp_path / "plain", per_tensor_seeds=per_tensor)
    _assert_same_checkpoint(direct, write_quantized(plain, tmp_path / "quantized", progress=False, bits=bits))
    marker = json.loads((direct / "config.json").read_text())[QUANTIZED_MARKER]
    assert marker["made_by"] == f"python -m service make-model --preset {preset} --bits {bits}"


def test_the_embedded_tiny_model_keeps_its_weights(tmp_path):
    """`tiny` is written as it always was (transformers' init after torch.manual_seed(0)), not per tensor."""
    from transformers import AutoConfig

    path = make_checkpoint("tiny", tmp_path / "tiny")
    plain, config = load_file(path / "model.safetensors"), AutoConfig.from_pretrained(path)
    assert "lm_head.weight" not in plain and config.tie_word_embeddings
    legacy = random_weights.legacy_model(config, torch.float32).state_dict()
    assert all(torch.equal(t, legacy[n]) for n, t in plain.items())


def test_a_tensor_is_the_same_whatever_the_order_and_chunks_it_is_generated_in():
    shapes = {"a.weight": (5, 3, 4), "b.weight": (2500, 1000), "c.bias": (7,), "d.weight": (7,)}
    whole = {n: random_weights.generate(n, s, torch.bfloat16, 0.02) for n, s in shapes.items()}
    assert random_weights.rows_per_block(shapes["b.weight"]) == 1048  # blocks of 2²⁰ elements
    for name in reversed(shapes):  # another order, and rows in pieces that cut across the blocks
        rows = shapes[name][0]
        pieces = [
            random_weights.generate(name, shapes[name], torch.bfloat16, 0.02, s, s + 333) for s in range(0, rows, 333)
        ]
        assert torch.equal(torch.cat(pieces), whole[name])
    assert torch.equal(whole["c.bias"], torch.zeros(7, dtype=torch.bfloat16))
    assert torch.equal(whole["d.weight"], torch.ones(7, dtype=torch.bfloat16))
    assert not torch.equal(whole["a.weight"][0], whole["a.weight"][1])  # each expert its own seed
    std = random_weights.generate("e.weight", (1000, 1000), torch.float32, 0.3).std().item()
    assert abs(std - 0.3) < 0.003


def test_the_random_tiny_moe_stores_what_its_config_and_the_releases_layout_say(tiny_moe_dir):
    from transformers import AutoConfig

    source = random_weights.RandomTensors(AutoConfig.from_pretrained(tiny_moe_dir), torch.float32)
    stored = load_file(tiny_moe_dir / "model.safetensors")
    assert sorted(stored) == sorted(source.shapes)
    assert all(torch.equal(t, source.read([n])[n]) for n, t in stored.items())


def test_the_size_estimate_is_what_is_written(tmp_path, tiny_moe_dir):
    """estimated_bytes (from the config on the meta device) against the files: headers apart, exact."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_moe_dir)
    written = {None: [tiny_moe_dir / "model.safetensors"]}
    for bits in (8, 4):
        path = make_checkpoint("tiny-moe", tmp_path / f"q{bits}", bits=bits)
        written[bits] = sorted(path.glob("*.safetensors"))
    for bits, files in written.items():
        size = sum(f.stat().st_size for f in files)
        assert 0 <= size - estimated_bytes(config, bits) < 16384 * len(files), bits


def test_a_4bit_random_checkpoint_loads_as_a_mixture_of_experts(cache_dir, tmp_path):
    from service.model.loading import load_model
    from service.quant.int4_linear import Int4Linear

    path = make_checkpoint("tiny-moe", tmp_path / "m", bits=4)
    loaded = load_model(make_settings(cache_dir, model_path=path))
    assert loaded.is_random
    experts = loaded.model.model.language_model.layers[0].mlp.experts
    assert any(isinstance(m, Int4Linear) for m in experts.modules())


def test_the_sizes_docs_models_md_gives_are_the_estimate_from_the_config():
    from service.quant.fusion import model_class

    rows = [line for line in (ROOT / "docs" / "models.md").read_text().splitlines() if " GB" in line]
    for preset in ("30b-a3b", "30b-a3b-e32"):
        config = model_config(preset)
        with torch.device("meta"):
            parameters = sum(t.numel() for t in model_class(config)(config).parameters())
        row = next(line for line in rows if line.startswith(f"| `{preset}` |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == f"{parameters / 1e9:.2f} B"
        for cell, bits in zip(cells[2:], (None, 8, 4)):
            assert cell.startswith(f"{estimated_bytes(config, bits) / 1e9:.1f} GB"), (preset, bits, cell)


def test_30b_a3b_is_refused_in_bf16_with_its_size_and_the_command(tmp_path):
    with pytest.raises(ValueError) as refused:
        make_checkpoint("30b-a3b", tmp_path / "x")
    assert "~62 GB in bf16" in str(refused.value) and "--preset 30b-a3b --bits 4" in str(refused.value)
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_cli_make_model_bits_4_shows_progress_and_says_how_to_serve(tmp_path):
    out = tmp_path / "m"
    run = subprocess.run(
        [sys.executable, "-m", "service", "make-model", "--preset", "tiny-moe", "--bits", "4", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "quantizing" in run.stderr and "100%" in run.stderr  # the tqdm bar, in bytes
    assert f"MODEL_PATH={out}" in run.stdout and (out / "resident.safetensors").exists()
    again = subprocess.run(
        [sys.executable, "-m", "service", "make-model", "--preset", "30b-a3b", str(tmp_path / "big")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2 and "--bits 4" in again.stderr and "Traceback" not in again.stderr


# A 30B-A3B-e32 scaled down to ~0.35 B parameters (~0.7 GB in bf16, ~0.25 GB at 4 bits): 3 layers of
# 48 experts, every per-token shape smaller. The writer's own output buffer is made 32 MiB (256 by
# default) so that what the test bounds is the writer's working set.
SCALED = {
    "text": dict(
        hidden_size=1024,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_experts=48,
        moe_intermediate_size=384,
        vocab_size=16384,
    ),
    "vision": dict(depth=2, out_hidden_size=1024, deepstack_visual_indexes=[0, 1]),
}
SHARD = 32 << 20

CHILD = """
import json, math, sys, time
from pathlib import Path
import psutil
from service import native
from transformers import AutoConfig
from service.random_checkpoints.make import make_checkpoint
from service.random_checkpoints.random_weights import checkpoint_shapes
from service.quant.estimates import estimated_bytes

native.configure(Path(sys.argv[1]))
shapes = json.loads(sys.argv[3])
make_checkpoint("tiny-moe", Path(sys.argv[2]) / "warm-up", bits=4)  # imports, kernels, tokenizer trainer
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) from here on: not the warm-up's
base = psutil.Process().memory_info().rss
t0 = time.perf_counter()
out = make_checkpoint("30b-a3b-e32", Path(sys.argv[2]) / "scaled", bits=4, shapes=shapes, shard_bytes=int(sys.argv[4]))
seconds = time.perf_counter() - t0
hwm = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:"))
peak = int(hwm.split()[1]) * 1024
config = AutoConfig.from_pretrained(out)
sizes = {n: 2 * math.prod(s) for n, s in checkpoint_shapes(config).items()}
whole = [b for n, b in sizes.items() if ".mlp.experts." not in n]  # (the experts' are smaller)
print(json.dumps(dict(
    base=base, peak=peak, seconds=seconds, bf16=estimated_bytes(config, None), largest_bf16=max(whole),
    written=sum(f.stat().st_size for f in out.glob("*.safetensors")), estimate=estimated_bytes(config, 4),
)))
"""


@pytest.mark.slow
def test_writing_a_mixture_of_experts_4bit_takes_memory_for_a_tensor_not_the_model(cache_dir, tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(cache_dir), str(tmp_path), json.dumps(SCALED), str(SHARD)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    m = json.loads(run.stdout.strip().splitlines()[-1])
    growth = m["peak"] - m["base"]
    print(
        f"bf16 {m['bf16'] / 1e6:.0f} MB, written {m['written'] / 1e6:.0f} MB (estimate {m['estimate'] / 1e6:.0f}) "
        f"in {m['seconds']:.1f} s; largest Linear {m['largest_bf16'] / 1e6:.0f} MB in bf16; "
        f"peak RSS growth {growth / 1e6:.0f} MB (from {m['base'] / 1e6:.0f} to {m['peak'] / 1e6:.0f} MB)"
    )
    assert 200e6 < m["written"] < 400e6 and m["bf16"] > 600e6
    # The output buffer (32 MiB), a few MiB of source rows with their fp32 copies in quantization, and
    # the largest Linear's int8 rows while packed (a merger's 4608 × 4608: ~21 MB, twice) — not the
    # model: measured ~0.11 GB against 0.65 GB in bf16 (1.3 GB in fp32). Before the writer mapped its
    # large blocks apart (service/memory.py's unmapped_large_blocks), glibc's heap fragments held
    # 0.19–0.26 GB; a chunk read whole, or a widening sum over a whole Linear, adds 40–80 MB.
    assert growth < SHARD + 3 * m["largest_bf16"]
    assert growth < m["bf16"] / 4
