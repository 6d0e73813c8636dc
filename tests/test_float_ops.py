"""The fixed-order float operations (service/native/float_ops.py) against torch's: the same math
within float rounding, on the shapes the models give them (odd lengths, strided rows, heads of 72),
each row's result its own, and the kernel built for AVX2 the same bits as this CPU's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from service.native import float_ops

from conftest import HAS_AVX512, ONLY_AVX2


def close(a: torch.Tensor, b: torch.Tensor, tolerance: float = 1e-6) -> bool:
    return float((a - b).abs().max() / b.abs().max()) < tolerance


def rows(*shape, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_norms_activations_and_softmax_compute_torchs_math():
    x, w, b = rows(37, 1000), rows(1000, seed=1), rows(1000, seed=2)
    assert close(float_ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (1000,), w, 1e-6))
    assert close(float_ops.layer_norm(x, w, b, 1e-6), F.layer_norm(x, (1000,), w, b, 1e-6))
    assert close(float_ops.softmax(x), x.softmax(-1)) and close(float_ops.log_softmax(x), x.log_softmax(-1))
    assert close(float_ops.silu(x), F.silu(x)) and close(float_ops.sigmoid(x), x.sigmoid())
    assert close(float_ops.gelu(x, "tanh"), F.gelu(x, approximate="tanh"))
    assert close(float_ops.gelu(x), F.gelu(x))
    angles = torch.arange(0, 300_000, 7).float() * 0.37  # positions up to M-RoPE's long contexts
    cos, sin = float_ops.cos_sin(angles)
    assert torch.equal(cos, angles.double().cos().float()) and torch.equal(sin, angles.double().sin().float())


def test_strided_rows_are_read_where_they_are():
    """q and k heads inside a fused qkv row; gate and up halves of one gate_up row."""
    qkv = rows(9, 300)
    heads = qkv[:, :256].view(9, 4, 64)
    assert close(float_ops.rms_norm(heads, None, 1e-6), F.rms_norm(heads, (64,), eps=1e-6))
    gate, up = rows(7, 96).chunk(2, dim=-1)
    assert torch.equal(float_ops.silu_mul(gate, up), float_ops.silu(gate) * up)


@pytest.mark.parametrize("m,k,n", [(1, 2048, 6144), (5, 100, 37), (33, 64, 80), (300, 1536, 72)])
def test_the_linear_computes_torchs_product_and_each_row_alone(m, k, n):
    weight, bias, x = rows(n, k, scale=0.05), rows(n, seed=1), rows(m, k, seed=2)
    linear = float_ops.Linear(weight, bias)
    y = linear(x)
    assert close(y, F.linear(x, weight, bias), 1e-5)
    assert torch.equal(linear.weight, weight)
    assert all(torch.equal(linear(x[i : i + 1]), y[i : i + 1]) for i in (0, m // 2, m - 1))


def test_a_tied_embedding_reads_its_rows_from_the_packed_lm_head():
    weight = rows(100, 48)
    embedding = float_ops.PackedEmbedding(float_ops.Linear(weight))
    ids = torch.tensor([[0, 17, 99, 16, 15]])
    assert torch.equal(embedding(ids), weight[ids]) and torch.equal(embedding.weight, weight)


def reference_attention(qkv, cos, sin, starts, heads):
    tokens, dim = qkv.shape[0], qkv.shape[1] // (3 * heads)
    q, k, v = qkv.reshape(tokens, 3, heads, dim).permute(1, 0, 2, 3).unbind(0)

    def rotate(x):
        half = x[..., : dim // 2], x[..., dim // 2 :]
        return x * cos[:, None] + torch.cat((-half[1], half[0]), -1) * sin[:, None]

    q, k = rotate(q), rotate(k)
    out = []
    for a, b in zip(starts[:-1], starts[1:]):
        segment = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(*segment, scale=dim**-0.5)[0].transpose(0, 1).reshape(b - a, -1))
    return torch.cat(out)


@pytest.mark.parametrize("heads,dim,starts", [(16, 64, [0, 196]), (4, 72, [0, 13, 100, 133]), (2, 16, [0, 1, 40])])
def test_the_vision_attention_is_sdpa_per_segment_after_rotary(heads, dim, starts):
    tokens = starts[-1]
    qkv, angles = rows(tokens, 3 * heads * dim, scale=1.0), rows(tokens, dim, seed=1)
    cos, sin = angles.cos(), angles.sin()
    got = float_ops.vision_attention(qkv, cos, sin, starts, heads, dim**-0.5)
    assert close(got, reference_attention(qkv, cos, sin, starts, heads), 1e-5)
    first = starts[1]  # a segment's outputs are its own: alone, the same bits
    alone = float_ops.vision_attention(qkv[:first].contiguous(), cos[:first], sin[:first], [0, first], heads, dim**-0.5)
    assert torch.equal(alone, got[:first])


_ISA_PROBE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from service import native
native.configure(sys.argv[2])
from service.native import float_ops
from test_float_ops import rows
x, w, b = rows(37, 1000), rows(1000, seed=1), rows(1000, seed=2)
qkv, angles = rows(133, 3 * 4 * 72, scale=1.0), rows(133, 72, seed=1)
out = {
    "rms": float_ops.rms_norm(x, w, 1e-6), "layer": float_ops.layer_norm(x, w, b, 1e-6),
    "softmax": float_ops.softmax(x), "log_softmax": float_ops.log_softmax(x), "silu": float_ops.silu(x),
    "sigmoid": float_ops.sigmoid(x), "gelu_tanh": float_ops.gelu(x, "tanh"), "gelu": float_ops.gelu(x),
    "linear": float_ops.Linear(rows(72, 1000, seed=3), b[:72])(x),
    "vision": float_ops.vision_attention(qkv, angles.cos(), angles.sin(), [0, 13, 133], 4, 72**-0.5),
}
print(json.dumps({name: t.flatten().tolist() for name, t in out.items()}))
"""


@pytest.mark.skipif(not HAS_AVX512, reason=ONLY_AVX2)
@pytest.mark.slow
def test_the_avx2_build_gives_the_same_bits(cache_dir):
    """NATIVE_MARCH=x86-64-v3: every operation's bits as this CPU's build (floats through JSON: exact)."""
    from conftest import run_probe

    assert run_probe(_ISA_PROBE, cache_dir, {"NATIVE_MARCH": "x86-64-v3"}) == run_probe(_ISA_PROBE, cache_dir, {})
