"""The service's own vision tower (service/vision/tower.py) against transformers' Qwen3VLVisionModel:
the same tensor names, shapes and buffers, and the same features within float rounding (fp32: 1e-5 of
the largest value — the tower's float operations are service/native/float_ops.py's, the same bits on
every CPU, which round otherwise than torch's) on the tiny checkpoint and the tiny mixture of experts,
for one image and for two of different grids in one call; the tower's own paths the same bits."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from service.model.loading import load_processor
from service.vision.steps import _tower_steps, run_to_end
from service.vision.tower import VisionTower

from conftest import ROOT
from imaging import pattern

# Patch grids 14 × 20 and 18 × 16 after the processor's resize: not square, and different.
SIZES = [(320, 224), (128, 160)]


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def checkpoint(request):
    """(directory, transformers' whole model in fp32 with sdpa, image processor) per tiny checkpoint."""
    from transformers import AutoModelForImageTextToText

    path = request.getfixturevalue("tiny_dir" if request.param == "tiny" else "tiny_moe_dir")
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return path, model.eval(), load_processor(path).image_processor


def served_tower(path, config) -> VisionTower:
    """Built on the meta device and given the checkpoint's `model.visual.*` tensors by name, as the loader does."""
    from safetensors import safe_open

    with torch.device("meta"):
        tower = VisionTower(config.vision_config)
    with safe_open(path / "model.safetensors", "pt") as f:
        state = {n.removeprefix("model.visual."): f.get_tensor(n) for n in f.keys() if n.startswith("model.visual.")}
    tower.load_state_dict(state, strict=True, assign=True)
    return tower.eval()


@pytest.fixture(scope="module")
def towers(checkpoint):
    path, model, _ = checkpoint
    return served_tower(path, model.config), model


def inputs(checkpoint, sizes):
    """pixel_values and image_grid_thw from the checkpoint's own processor."""
    images = [pattern(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    out = checkpoint[2](images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def assert_same_bits(ours, theirs_pooler, theirs_deepstack):
    assert torch.equal(ours.pooler, theirs_pooler)
    assert len(ours.deepstack) == len(theirs_deepstack) > 0
    assert all(torch.equal(a, b) for a, b in zip(ours.deepstack, theirs_deepstack))


def assert_within_float_rounding(ours, theirs_pooler, theirs_deepstack):
    assert len(ours.deepstack) == len(theirs_deepstack) > 0
    for a, b in zip([ours.pooler, *ours.deepstack], [theirs_pooler, *theirs_deepstack]):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5


def test_names_shapes_and_buffers_are_transformers(towers):
    tower, model = towers
    hf = model.model.visual
    assert {n: t.shape for n, t in tower.state_dict().items()} == {n: t.shape for n, t in hf.state_dict().items()}
    assert [n for n, _ in tower.named_buffers()] == [n for n, _ in hf.named_buffers()]
    assert not [n for n, t in [*tower.named_parameters(), *tower.named_buffers()] if t.is_meta]
    for name, buffer in hf.named_buffers():  # the rotary frequencies: computed, equal, and not in the checkpoint
        assert torch.equal(tower.get_buffer(name), buffer)
    tower.reset_buffers()
    assert torch.equal(tower.rotary_pos_emb.inv_freq, hf.rotary_pos_emb.inv_freq)
    copy = VisionTower(model.config.vision_config)
    copy.load_state_dict(hf.state_dict(), strict=True)
    assert tower.dtype == hf.dtype == torch.float32
    for attribute in ("num_grid_per_side", "interpolation_mode", "interpolation_align_corners", "spatial_merge_size"):
        assert getattr(tower, attribute) == getattr(hf, attribute)
    assert list(tower.deepstack_visual_indexes) == list(hf.deepstack_visual_indexes)


@torch.inference_mode()
def test_one_image_in_steps_and_whole_gives_transformers_features(checkpoint, towers):
    tower, model = towers
    pixel_values, grid = inputs(checkpoint, SIZES[:1])
    theirs = model.model.get_image_features(pixel_values, grid)
    pooler, deepstack = theirs.pooler_output[0], [layer[0] for layer in theirs.deepstack_features]
    in_steps = run_to_end(_tower_steps(tower, pixel_values, grid))
    assert_within_float_rounding(in_steps, pooler, deepstack)
    [ours] = tower.image_features(pixel_values, grid)
    assert_same_bits(ours, in_steps.pooler, in_steps.deepstack)


@torch.inference_mode()
def test_two_images_of_different_grids_in_one_call_give_transformers_features(checkpoint, towers):
    tower, model = towers
    pixel_values, grid = inputs(checkpoint, SIZES)
    assert grid[0].tolist() != grid[1].tolist()
    theirs = model.model.get_image_features(pixel_values, grid)
    ours = tower.image_features(pixel_values, grid)
    assert len(ours) == len(theirs.pooler_output) == 2
    alone = torch.split(pixel_values, grid.prod(-1).tolist())
    for i, features in enumerate(ours):
        deepstack = [layer[i] for layer in theirs.deepstack_features]
        assert_within_float_rounding(features, theirs.pooler_output[i], deepstack)
        [by_itself] = tower.image_features(alone[i], grid[i : i + 1])  # each image's features its own
        assert_same_bits(features, by_itself.pooler, by_itself.deepstack)


class CountingLinear(nn.Module):
    """A stand-in for the service's INT8 / 4-bit Linears: only ever called as `linear(x)`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.inner, self.calls = linear, 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


@torch.inference_mode()
def test_replaced_linears_are_the_ones_called(checkpoint, towers):
    tower, model = towers
    pixel_values, grid = inputs(checkpoint, SIZES[:1])
    before = tower.image_features(pixel_values, grid)[0]
    tower = served_tower(checkpoint[0], model.config)
    replaced = []
    for name, module in list(tower.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, child = name.rpartition(".")
            replaced.append(CountingLinear(module))
            setattr(tower.get_submodule(parent), child, replaced[-1])
    after = tower.image_features(pixel_values, grid)[0]
    assert all(linear.calls == 1 for linear in replaced) and len(replaced) > 10
    assert_same_bits(after, before.pooler, before.deepstack)


def test_importing_the_tower_imports_no_modeling_code():
    """transformers.vision_utils needs configuration_utils, which imports modeling_rope_utils (rope
    parameter checks, no model): that one is allowed; modeling_utils and the models' modeling_* are not."""
    code = (
        "import service.vision.tower, sys; "
        "found = [m for m in sys.modules if m == 'transformers.modeling_utils' or '.modeling_' in m]; "
        "assert found == ['transformers.modeling_rope_utils'] or not found, found"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
