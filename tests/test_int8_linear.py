"""Per-token INT8: a row's output never depends on the other rows of the call, a spike costs only
its own token, and the kernels give the same bits with and without VNNI.

Each property is also checked to fail on torch's per-tensor dynamic quantization (the
`activations="per_tensor"` mode, what the service ran before), so the tests can tell the two apart.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from conftest import ROOT, make_settings
from service.fusion import FusedTextAttention, FusedTextMLP
from service.int8_linear import Int8Linear, empty_qweight
from service.loading import load_model
from service.quantized import quantize_in_place


def layer(activations="per_token", bias=True, in_features=2048, out_features=512, seed=0) -> Int8Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    nn.init.normal_(linear.weight, std=0.02)
    return Int8Linear.from_float(linear, activations)


def rows(m, in_features=2048, seed=1) -> torch.Tensor:
    return torch.randn(m, in_features, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 16, 63, 64, 65, 218])
def test_a_rows_output_is_the_same_bits_in_a_call_of_any_length(m):
    lin, x = layer(), rows(218)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(m)])
    assert torch.equal(lin(x[:m]), alone)


@pytest.mark.parametrize("spike", ["row x1000", "one huge channel"])
def test_a_spiking_neighbour_leaves_a_rows_output_unchanged(spike):
    x = rows(4)
    spiked = x.clone()
    if spike == "row x1000":
        spiked[1] *= 1000
    else:
        spiked[1, 7] = 1000 * spiked[1].abs().max()
    per_token, per_tensor = layer("per_token"), layer("per_tensor")
    keep = [0, 2, 3]
    assert torch.equal(per_token(spiked)[keep], per_token(x)[keep])
    exact = x[keep] @ per_token.weight_rows()[0].float().T * per_token.weight_rows()[1] + per_token.bias
    error = (per_tensor(spiked)[keep] - exact).norm() / exact.norm()
    assert error > 0.5  # per-tensor: the neighbour's scale flattened these rows


def test_rows_of_zeros_give_the_bias_and_do_not_poison_their_neighbours():
    lin, x = layer(), rows(3)
    x[1] = 0
    y = lin(x)
    assert torch.isfinite(y).all()
    assert torch.equal(y[1], lin.bias)
    assert torch.equal(y[[0, 2]], lin(x[[0, 2]]))


def test_every_value_at_its_rows_maximum_is_computed_without_saturation():
    """The worst case for CPUs whose u8×s8 pair sums saturate at int16 (AVX2 without VNNI)."""
    lin = layer(bias=False)
    x = torch.ones(4, 2048)
    x[:, ::2] = -1
    x[1] *= 1e-3
    weight, scales = lin.weight_rows()
    exact = x @ (weight.float() * scales[:, None]).T
    assert ((lin(x) - exact).norm() / exact.norm()) < 1e-5


def test_a_fused_projection_gives_each_part_exactly_its_own_output():
    parts = [layer(bias=False, out_features=n, seed=s) for s, n in enumerate((256, 128, 128))]
    weights = [p.weight_rows() for p in parts]
    qweight, view = empty_qweight((512, 2048), torch.cat([s for _, s in weights]))
    view.copy_(torch.cat([w for w, _ in weights]))
    fused = Int8Linear(qweight, None)
    x = rows(5)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=1))


_ISA_PROBE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from test_int8_linear import layer, rows
x = rows(6)
x[2] = 1.0; x[2, ::2] = -1.0
print(json.dumps(layer()(x).flatten().tolist()))
"""


def test_the_kernel_gives_the_same_bits_with_and_without_vnni():
    """FBGEMM_ENABLE_INSTRUCTIONS=AVX2 makes FBGEMM take the AVX2 path (u8×s8 pairs summed in int16,
    as on CPUs without VNNI) on any x86 CPU: its answer must equal the default path's bit for bit."""

    def run(env):
        out = subprocess.run([sys.executable, "-c", _ISA_PROBE, str(ROOT / "tests")], capture_output=True, text=True,
                             env={**os.environ, **env}, timeout=120, check=True)
        return json.loads(out.stdout)

    assert run({"FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"}) == run({})


# -- the model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(cache_dir, tiny_dir):
    """The tiny checkpoint in fp32, and INT8 with per-token and with per-tensor activations."""
    fp32 = load_model(make_settings(cache_dir, quantization="fp32"))
    made = {"fp32": fp32.model}
    for activations in ("per_token", "per_tensor"):
        made[activations] = copy.deepcopy(fp32.model)
        quantize_in_place(made[activations], activations=activations)
    return made, fp32.processor.tokenizer


def test_every_int8_linear_quantizes_per_token_and_a_decoder_layer_makes_four_calls(cache_dir, tiny_dir):
    model = load_model(make_settings(cache_dir, quantization="int8")).model
    assert not any(type(m) is nn.Linear for m in model.modules())
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert int8 and all(m.activations == "per_token" for m in int8)
    assert any(m in int8 for m in model.model.visual.modules())
    for decoder_layer in model.model.language_model.layers:
        assert isinstance(decoder_layer.self_attn, FusedTextAttention) and isinstance(decoder_layer.mlp, FusedTextMLP)
        assert sum(isinstance(m, Int8Linear) for m in decoder_layer.modules()) == 4


SPIKED_TOKEN = 3


def logits_with_spike(model, ids, kind: str | None) -> torch.Tensor:
    """Logits of every token but SPIKED_TOKEN, with that token's MLP down-projection input spiked
    in the first and the last decoder layer (as real checkpoints' massive activations do)."""

    def spike(module, args):
        x = args[0].clone()
        if kind == "row x1000":
            x[:, SPIKED_TOKEN] *= 1000
        else:
            x[:, SPIKED_TOKEN, 5] = 1000 * x[:, SPIKED_TOKEN].abs().max()
        return (x,)

    layers = model.model.language_model.layers
    hooks = [layers[i].mlp.down_proj.register_forward_pre_hook(spike) for i in (0, len(layers) - 1)] if kind else []
    try:
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return logits[[i for i in range(ids.shape[1]) if i != SPIKED_TOKEN]]


@pytest.mark.parametrize("kind", ["row x1000", "one huge channel"])
def test_a_spike_in_one_token_moves_the_other_tokens_no_more_than_int8_noise(models, kind):
    made, tokenizer = models
    ids = tokenizer("Tell me a long story about a red square and a blue circle on a table, please.",
                    return_tensors="pt").input_ids

    def error(activations, spiked):
        ref = logits_with_spike(made["fp32"], ids, kind if spiked else None)
        got = logits_with_spike(made[activations], ids, kind if spiked else None)
        return float((got - ref).norm() / ref.norm())

    noise = error("per_token", spiked=False)
    assert error("per_token", spiked=True) <= 1.25 * noise
    assert error("per_tensor", spiked=True) > 5 * noise  # what the per-tensor path did
