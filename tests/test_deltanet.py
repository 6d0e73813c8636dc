"""Qwen3.5's linear-attention token mixer (service/model/deltanet.py, service/native/deltanet.c):
transformers' Gated DeltaNet math within float rounding, and a token's output and the state it
leaves the same bits whichever call computes it — alone, in pieces, in a batch, built for this CPU or
for AVX2 — and after a decode step's rejected guesses are taken back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from service.model.deltanet import DeltaNetKernel, DeltaNetMixer, RecurrentLayer, Shape, TorchDeltaNet

# Qwen3.5's proportions (value heads twice the key heads), heads of 32: a few of the kernel's 16-float vectors
SHAPE = Shape(key_heads=2, value_heads=4, key_dim=32, value_dim=32, kernel=4)
TOKENS = 29


class _Module:
    """The checkpoint tensors a mixer reads, random."""

    def __init__(self, shape: Shape, generator: torch.Generator):
        self.conv1d = type("conv", (), {})()
        self.conv1d.weight = torch.randn(shape.conv_channels, 1, shape.kernel, generator=generator) * 0.5
        self.A_log = torch.empty(shape.value_heads).uniform_(0.01, 16, generator=generator).log()
        self.dt_bias = torch.rand(shape.value_heads, generator=generator)
        self.norm = type("norm", (), {})()
        self.norm.weight = 1 + 0.1 * torch.randn(shape.value_dim, generator=generator)


@pytest.fixture(scope="module")
def inputs():
    generator = torch.Generator().manual_seed(7)
    module = _Module(SHAPE, generator)
    projected = torch.randn(TOKENS, sum(SHAPE.projection_widths), generator=generator)
    projected[:, -SHAPE.value_heads :] *= 3  # `a`: decays from ~0 to ~1
    return module, projected


def _split(projected):
    """The two input projections' rows (q/k/v/z, b/a) of the fixture's one tensor of all six parts."""
    at = SHAPE.conv_channels + SHAPE.values
    return projected[:, :at], projected[:, at:]


def _mixer(module, kernel) -> DeltaNetMixer:
    return DeltaNetMixer(module, SHAPE, 1e-6, kernel)


def _run(mixer, projected, pieces, layer=None):
    layer = layer or RecurrentLayer(SHAPE)
    outs, at = [], 0
    for n in pieces:
        outs.append(mixer([layer], *_split(projected[at : at + n]), [n], [False]))
        at += n
    return torch.cat(outs), layer


def _reference(module, projected):
    """transformers' Qwen3.5 layer math: conv1d, SiLU, the recurrent delta rule, the gated RMSNorm."""
    s = SHAPE
    qkv, z, b, a = projected.split(s.projection_widths, dim=-1)
    weight = module.conv1d.weight
    mixed = F.silu(F.conv1d(qkv.t()[None], weight, padding=s.kernel - 1, groups=s.conv_channels)[:, :, :TOKENS])
    q, k, v = mixed[0].t().split([s.key_heads * s.key_dim, s.key_heads * s.key_dim, s.values], -1)
    out, state = torch_recurrent_gated_delta_rule(
        q.reshape(1, TOKENS, s.key_heads, s.key_dim),
        k.reshape(1, TOKENS, s.key_heads, s.key_dim),
        v.reshape(1, TOKENS, s.value_heads, s.value_dim),
        g=(-module.A_log.exp() * F.softplus(a + module.dt_bias))[None],
        beta=b.sigmoid()[None],
        initial_state=None,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    out = out.reshape(-1, s.value_dim)
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6) * module.norm.weight
    out = out * F.silu(z.reshape(-1, s.value_dim))
    return out.reshape(TOKENS, s.values), state[0]


@pytest.mark.parametrize("kernel", ["c", "torch"])
def test_the_mixer_computes_transformers_gated_delta_rule(inputs, kernel):
    module, projected = inputs
    mixer = _mixer(module, DeltaNetKernel.load() if kernel == "c" else TorchDeltaNet())
    out, layer = _run(mixer, projected, [TOKENS])
    want, state = _reference(module, projected)
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-4)
    assert torch.allclose(layer.state, state, atol=1e-5, rtol=1e-4)
    assert layer.length == TOKENS


def test_a_token_has_the_same_bits_alone_in_pieces_and_in_a_batch(inputs):
    module, projected = inputs
    mixer = _mixer(module, DeltaNetKernel.load())
    whole, layer = _run(mixer, projected, [TOKENS])
    one_by_one, alone = _run(mixer, projected, [1] * TOKENS)
    pieces, pieced = _run(mixer, projected, [5, 1, 2, 13, 8])
    assert torch.equal(one_by_one, whole) and torch.equal(pieces, whole)
    for other in (alone, pieced):
        assert torch.equal(other.state, layer.state) and torch.equal(other.conv, layer.conv)
    # beside another sequence's rows in the same call
    first, second = RecurrentLayer(SHAPE), RecurrentLayer(SHAPE)
    generator = torch.Generator().manual_seed(3)
    neighbour = torch.randn(11, projected.shape[1], generator=generator)
    out = mixer([first, second], *_split(torch.cat([projected[:20], neighbour])), [20, 11], [False, False])
    assert torch.equal(out[:20], whole[:20])


def test_the_avx2_build_gives_the_same_bits_as_this_cpus(inputs):
    """16-float vectors, one lane tree, no fused multiply-adds, its own exp and log: one AVX-512
    register or two AVX2 ones compute the same numbers."""
    module, projected = inputs
    here, _ = _run(_mixer(module, DeltaNetKernel.load()), projected, [TOKENS])
    avx2, _ = _run(_mixer(module, DeltaNetKernel.load(march="x86-64-v3")), projected, [TOKENS])
    assert torch.equal(here, avx2)


def test_rejected_guesses_leave_the_state_as_if_never_fed(inputs):
    """A decode step feeds its token and four guesses (undoable); two are accepted: the state is
    the one a step of the first three tokens leaves, and the next tokens get the bits of a run that
    never saw the rejected ones."""
    module, projected = inputs
    mixer = _mixer(module, DeltaNetKernel.load())
    whole, _ = _run(mixer, projected, [TOKENS])
    layer = RecurrentLayer(SHAPE)
    _run(mixer, projected[:10], [10], layer)
    mixer([layer], *_split(projected[10:15]), [5], [True])
    layer.rewind(2, mixer)
    assert layer.length == 13
    rest, _ = _run(mixer, projected[13:], [TOKENS - 13], layer)
    assert torch.equal(rest, whole[13:])
    with pytest.raises(ValueError):  # only the last undoable call can be taken back
        layer.rewind(1, mixer)
