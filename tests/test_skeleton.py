"""The service's own modules (service/model/skeleton.py, weights.py, positions.py) against transformers'.

Serving builds the model without transformers' modeling code; these tests keep transformers as the
reference: the same checkpoint loaded both ways holds the same tensors under the same names (the
service's projections fused, transformers' fused by service/quant/fusion.py), the M-RoPE positions
are transformers' own for pictures, clips and text, and a served start imports no modeling code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.model.skeleton import skeleton
from service.model.weights import load_weights
from service.quant.fusion import fuse_projections

from conftest import transformers_model

ROOT = Path(__file__).resolve().parent.parent
# what transformers' modeling code brings (seconds of a start); its configuration classes need the rope
# parameters' checks (`modeling_rope_utils`, milliseconds) and the auto-mapping names, which are fine
HEAVY = ("transformers.modeling_utils", "transformers.processing_utils", "torch._dynamo")
LIGHT = ("transformers.modeling_rope_utils", "transformers.models.auto.modeling_auto")


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_a_checkpoint_loads_into_the_same_tensors_under_the_same_names(preset, tiny_dir, tiny_moe_dir):
    from transformers import AutoConfig

    path = tiny_dir if preset == "tiny" else tiny_moe_dir
    reference = transformers_model(path)
    fuse_projections(reference)
    ours = skeleton(AutoConfig.from_pretrained(path))
    load_weights(ours, path, torch.float32)
    theirs = dict(reference.named_parameters(remove_duplicate=False))
    mine = dict(ours.named_parameters(remove_duplicate=False))
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[n], theirs[n]) for n in mine), [n for n in mine if not torch.equal(mine[n], theirs[n])]
    mine_buffers, their_buffers = dict(ours.named_buffers()), dict(reference.named_buffers())
    for name, buffer in mine_buffers.items():  # rotary frequencies: computed, not stored
        assert torch.equal(buffer, their_buffers[name]), name
    tied = ours.lm_head.weight is ours.get_input_embeddings().weight
    assert tied == (reference.lm_head.weight is reference.get_input_embeddings().weight)


def test_an_incomplete_checkpoint_is_refused_naming_what_is_missing(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    for file in tiny_dir.iterdir():
        if file.suffix != ".safetensors":
            (tmp_path / file.name).symlink_to(file)
    tensors = {}
    for file in tiny_dir.glob("*.safetensors"):
        tensors.update(load_file(file))
    del tensors["model.language_model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up_proj"):
        load_weights(skeleton(AutoConfig.from_pretrained(tmp_path)), tmp_path)


def _grid(t, h, w):
    return torch.tensor([[t, h, w]])


@pytest.mark.parametrize(
    "types, images, videos",
    [
        ([0] * 9, None, None),
        ([0] * 3 + [1] * 4 + [0] * 2, _grid(1, 4, 4), None),
        ([0] * 2 + [1] * 6 + [0] * 3 + [1] * 4 + [0], torch.cat([_grid(1, 4, 6), _grid(1, 4, 4)]), None),
        ([0] * 2 + [2] * 4 + [0] * 2 + [2] * 4 + [0] * 2, None, _grid(2, 4, 4)),
        ([0] + [1] * 4 + [0] * 2 + [2] * 6 + [0] * 2 + [2] * 6 + [0], _grid(1, 4, 4), _grid(2, 6, 4)),
    ],
    ids=["text", "picture", "two-pictures", "clip", "picture-and-clip"],
)
def test_m_rope_positions_are_transformers_own(types, images, videos, tiny_dir):
    from transformers import AutoConfig

    reference = transformers_model(tiny_dir)
    config = AutoConfig.from_pretrained(tiny_dir)
    ours = skeleton(config)
    ids = torch.arange(len(types))[None]
    kinds = torch.tensor([types])
    want = reference.model.get_rope_index(
        ids, kinds, None if images is None else images.clone(), None if videos is None else videos.clone()
    )
    got = ours.model.get_rope_index(
        ids, kinds, None if images is None else images.clone(), None if videos is None else videos.clone()
    )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_served_start_imports_no_modeling_code_of_transformers(cache_dir, tiny_dir):
    """wsgi.py as Gunicorn's master imports it (the embedded model loaded): transformers' modeling code
    (seconds of a start) is never imported."""
    script = (
        (
            "import sys, wsgi; "
            "loaded = [m for m in sys.modules if m in HEAVY or ('.modeling_' in m and m not in LIGHT)]; "
            "print(loaded); assert not loaded"
        )
        .replace("HEAVY", repr(HEAVY))
        .replace("LIGHT", repr(LIGHT))
    )
    env = {**os.environ, "CACHE_DIR": str(cache_dir), "PRELOAD": "true"}
    env.pop("MODEL_PATH", None)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
