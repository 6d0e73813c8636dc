"""Per-token INT8: a row's output never depends on the other rows of the call, a spike costs only
its own token, and the kernels give the same bits with and without VNNI.

Each property is also checked to fail on torch's per-tensor dynamic quantization (the
`activations="per_tensor"` mode, what the service ran before), so the tests can tell the two apart.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from service.quant.in_place import quantize_in_place
from service.quant.int8_linear import Int8Linear, quantize_rows

from conftest import HAS_AVX512, run_probe

KERNEL_NAMES = ("fbgemm", "onednn", "native")
KERNELS = pytest.mark.parametrize("kernel", KERNEL_NAMES)


def float_layer(bias=True, in_features=2048, out_features=512, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    nn.init.normal_(linear.weight, std=0.02)
    return linear


def layer(
    activations="per_token", bias=True, in_features=2048, out_features=512, seed=0, kernel="fbgemm"
) -> Int8Linear:
    return Int8Linear.from_float(float_layer(bias, in_features, out_features, seed), activations, kernel)


def dequantized_weight(bias=True, in_features=2048, out_features=512, seed=0) -> torch.Tensor:
    """The int8 weight `layer` multiplies by, as fp32 (rows × their scales)."""
    rows, scales = quantize_rows(float_layer(bias, in_features, out_features, seed).weight.detach())
    return rows.float() * scales[:, None]


def rows(m, in_features=2048, seed=1) -> torch.Tensor:
    return torch.randn(m, in_features, generator=torch.Generator().manual_seed(seed))


@KERNELS
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 16, 17, 63, 64, 65, 218])
def test_a_rows_output_is_the_same_bits_in_a_call_of_any_length(m, kernel):
    lin, x = layer(kernel=kernel), rows(218)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(m)])
    assert torch.equal(lin(x[:m]), alone)


@KERNELS
@pytest.mark.parametrize("spike", ["row x1000", "one huge channel"])
def test_a_spiking_neighbour_leaves_a_rows_output_unchanged(spike, kernel):
    x = rows(4)
    spiked = x.clone()
    if spike == "row x1000":
        spiked[1] *= 1000
    else:
        spiked[1, 7] = 1000 * spiked[1].abs().max()
    per_token, per_tensor = layer("per_token", kernel=kernel), layer("per_tensor", kernel="fbgemm")
    keep = [0, 2, 3]
    assert torch.equal(per_token(spiked)[keep], per_token(x)[keep])
    exact = x[keep] @ dequantized_weight().T + per_token.bias
    error = (per_tensor(spiked)[keep] - exact).norm() / exact.norm()
    assert error > 0.5  # per-tensor: the neighbour's scale flattened these rows


@KERNELS
def test_rows_of_zeros_give_the_bias_and_do_not_poison_their_neighbours(kernel):
    lin, x = layer(kernel=kernel), rows(3)
    x[1] = 0
    y = lin(x)
    assert torch.isfinite(y).all()
    assert torch.equal(y[1], lin.bias)
    assert torch.equal(y[[0, 2]], lin(x[[0, 2]]))


@KERNELS
@pytest.mark.parametrize("m", [1, 4, 128])
def test_every_value_at_its_rows_maximum_is_computed_without_saturation(kernel, m):
    """The worst case for CPUs whose u8×s8 pair sums saturate at int16 (AVX2 without VNNI), on this
    CPU's own paths, for a decode row, a batch and a prefill piece (the VNNI-less paths of any CPU:
    test_the_kernels_give_the_same_bits_with_and_without_vnni)."""
    lin, x, exact = saturating_case(kernel, m)
    assert ((lin(x) - exact).norm() / exact.norm()) < 1e-5


def test_a_fused_projection_gives_each_part_exactly_its_own_output():
    floats = [float_layer(bias=False, out_features=n, seed=s) for s, n in enumerate((256, 128, 128))]
    parts = [Int8Linear.from_float(f) for f in floats]
    weights = [quantize_rows(f.weight.detach()) for f in floats]
    fused = Int8Linear(torch.cat([w for w, _ in weights]), torch.cat([s for _, s in weights]), None)
    x = rows(5)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=1))


@pytest.mark.parametrize("m", [1, 4, 5, 64, 218])
@pytest.mark.parametrize("shape", [(2048, 512), (72, 100), (64, 4)], ids=["2048-512", "72-100", "64-4"])
def test_the_three_kernels_give_the_same_bits(m, shape):
    """So which kernel serves (INT8_KERNEL, or the measurement) changes speed, never an answer —
    odd sizes included (the native kernel pads its tiles)."""
    x = rows(m, shape[0])
    fbgemm, onednn, own = (layer(in_features=shape[0], out_features=shape[1], kernel=k)(x) for k in KERNEL_NAMES)
    assert torch.equal(fbgemm, onednn) and torch.equal(fbgemm, own)


def saturating_case(kernel: str, m: int = 4) -> tuple[Int8Linear, torch.Tensor, torch.Tensor]:
    """The largest pair sums the kernels can meet: every weight at ±127 (rows of ±1) and every input
    at its row's maximum, signs matched, so each u8×s8 pair adds up to ±2·128·127 = ±32,512 — inside
    int16 with our 0…128 activations, where full 8-bit ones (0…255) would saturate AVX2's
    vpmaddubsw. `m` rows (the four cases repeated). Returns the layer, the input and the exact answer."""
    sign = torch.ones(2048)
    sign[::2] = -1
    weight = torch.stack([torch.ones(2048), -torch.ones(2048), sign, -sign])
    linear = nn.Linear(2048, 4, bias=False)
    linear.weight.data = weight
    x = torch.stack([torch.ones(2048), -torch.ones(2048), sign, 3 * sign]).repeat((m + 3) // 4, 1)[:m]
    int8, scales = quantize_rows(weight)  # ±127 (scale 1/127.5: torch's symmetric per-channel observer)
    assert int8.abs().min() == 127 and int8.abs().max() == 127
    return Int8Linear.from_float(linear, "per_token", kernel), x, x @ (int8.float() * scales[:, None]).T


# The outputs of both kernels, then the saturating case's relative error for our activations and,
# as the control that shows the paths really are the AVX2 ones, for full 8-bit activations (1…255).
_ISA_PROBE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import service.quant.int8_linear as int8_linear
from service import native
from test_int8_linear import KERNEL_NAMES, layer, rows, saturating_case
native.configure(sys.argv[2])
x = rows(6)
out = {k: layer(kernel=k)(x).flatten().tolist() for k in KERNEL_NAMES}
errors = {}
for k in KERNEL_NAMES:
    for m in (1, 4, 128):
        lin, worst, exact = saturating_case(k, m)
        error = lambda: ((lin(worst) - exact).abs().max() / exact.abs().max()).item()
        errors[f"{k} worst case error, m={m}"] = error()
        if k != "native":  # its scale and zero point are built in
            int8_linear.ACTIVATION_SCALE, int8_linear.ACTIVATION_ZERO_POINT = 1 / 127, 128
            errors[f"{k} 8-bit control error, m={m}"] = error()
            int8_linear.ACTIVATION_SCALE, int8_linear.ACTIVATION_ZERO_POINT = 2.0**-6, 64
lanes = int8_linear.native_library().int8_lanes()
print(json.dumps({"out": out, "errors": errors, "native lanes": lanes}))
"""


@pytest.mark.slow
def test_the_kernels_give_the_same_bits_with_and_without_vnni(cache_dir):
    """FBGEMM_ENABLE_INSTRUCTIONS=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2 make both libraries take their
    AVX2 paths (u8×s8 pairs summed in int16, as on CPUs without VNNI) on any x86 CPU, and
    NATIVE_MARCH=x86-64-v3 builds the native kernel for AVX2 (8 lanes, vpmaddubsw): their answers
    must equal the default paths' bit for bit, worst-case row included."""
    forced = {"FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "NATIVE_MARCH": "x86-64-v3"}
    avx2 = run_probe(_ISA_PROBE, cache_dir, forced)
    default = run_probe(_ISA_PROBE, cache_dir, {}) if HAS_AVX512 else avx2  # no AVX-512: the same paths
    assert avx2["out"] == default["out"]
    assert default["out"]["fbgemm"] == default["out"]["onednn"] == default["out"]["native"]
    assert avx2["native lanes"] == 8
    # On the AVX2 paths the saturating case is exact to float rounding, for a row, a batch and a
    # prefill piece; the same case with full 8-bit activations is not (a VNNI CPU hides that on its
    # default paths): the control that the forcing took effect.
    for kernel in KERNEL_NAMES:
        for m in (1, 4, 128):
            assert avx2["errors"][f"{kernel} worst case error, m={m}"] < 1e-5
            if kernel != "native":
                assert avx2["errors"][f"{kernel} 8-bit control error, m={m}"] > 0.1, avx2["errors"]


# -- the model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(loaded_model):
    """The tiny checkpoint in fp32, and INT8 with per-token and with per-tensor activations."""
    fp32 = loaded_model("fp32")
    made = {"fp32": fp32.model}
    for activations in ("per_token", "per_tensor"):
        made[activations] = copy.deepcopy(fp32.model)
        quantize_in_place(made[activations], activations=activations)
    return made, fp32.processor.tokenizer


def test_every_int8_linear_quantizes_per_token_and_a_decoder_layer_makes_four_calls(loaded_model):
    model = loaded_model("int8").model
    assert not any(type(m) is nn.Linear for m in model.modules())
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert int8 and all(m.activations == "per_token" for m in int8)
    assert any(m in int8 for m in model.model.visual.modules())
    for decoder_layer in model.model.language_model.layers:
        assert hasattr(decoder_layer.self_attn, "qkv_proj") and hasattr(decoder_layer.mlp, "gate_up_proj")
        assert sum(isinstance(m, Int8Linear) for m in decoder_layer.modules()) == 4


SPIKED_TOKEN = 3


def logits_with_spike(model, ids, kind: str | None) -> torch.Tensor:
    """Logits of every token but SPIKED_TOKEN, with that token's MLP down-projection input spiked
    in the first and the last decoder layer (as real checkpoints' massive activations do)."""

    def spike(module, args):
        x = args[0].clone()
        rows = x.view(-1, x.shape[-1])  # one prompt: its tokens' rows
        if kind == "row x1000":
            rows[SPIKED_TOKEN] *= 1000
        else:
            rows[SPIKED_TOKEN, 5] = 1000 * rows[SPIKED_TOKEN].abs().max()
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


@pytest.mark.slow  # quantizes two copies of the model of its own
@pytest.mark.parametrize("kind", ["row x1000", "one huge channel"])
def test_a_spike_in_one_token_moves_the_other_tokens_no_more_than_int8_noise(models, kind):
    made, tokenizer = models
    ids = tokenizer(
        "Tell me a long story about a red square and a blue circle on a table, please.", return_tensors="pt"
    ).input_ids

    def error(activations, spiked):
        ref = logits_with_spike(made["fp32"], ids, kind if spiked else None)
        got = logits_with_spike(made[activations], ids, kind if spiked else None)
        return float((got - ref).norm() / ref.norm())

    noise = error("per_token", spiked=False)
    assert error("per_token", spiked=True) <= 1.25 * noise
    assert error("per_tensor", spiked=True) > 5 * noise  # what the per-tensor path did
