"""The text decoder's forward for any number of rows per sequence: prefill pieces, decode steps,
batches — one computation, so a token's keys, values and logits have the same bits whichever path
computed them.

Every op works on each row alone: embeddings and vision features are copied in per row; RMSNorm,
rotary and the MLP's activation are row-wise; every INT8 Linear quantizes its input per row
(service/quant/int8_linear.py) and accumulates in integers; attention (service/model/attention.py) computes
each query from its own keys in an order fixed by its position. So a token computed as one of a
128-row prefill piece, alone in a decode step, or beside three other sequences gets the same
bits, and a cached prefix is the prefix a fresh prefill computes. And the same bits on every CPU:
the float operations around the kernels — norms, rotary sin/cos, SiLU, sigmoid, fp32 Linears — are
service/native/float_ops.py's, in one fixed order with one exp on every instruction set (torch's
take the CPU's own paths).

The layer math is transformers' Qwen3-VL text decoder, read from the loaded model: the same
weights and config, without its per-layer Python machinery (no masks: each sequence attends to
exactly its own cache; rotary cos/sin once per call for every layer; q and k heads normed in one
call; keys and values appended in place, service/model/kv.py; four Linear calls per layer,
service/quant/fusion.py). tests/test_forward.py checks it against transformers' forward. A
mixture-of-experts layer (Qwen3-VL-MoE) runs its router and experts in the same place as a dense
layer's MLP, each row alone too (service/model/moe.py; tests/test_moe.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ..native import float_ops
from ..quant.fusion import is_moe_block
from ..vision.features import VisionFeatures
from .attention import TorchAttention
from .deltanet import DeltaNetMixer, Shape, is_hybrid
from .hybrid import HybridCache
from .kv import GrowingCache
from .moe import MixtureOfExperts
from .mtp import DraftCache

log = logging.getLogger(__name__)


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: nn.Module | None  # a full-attention layer's fused q/k/v (Qwen3.5's: each query beside its gate)
    qk_norm: torch.Tensor | None  # (heads + kv_heads) × head_dim: q_norm's weight per query head, then k_norm's
    o_proj: nn.Module  # the attention's output projection (a linear-attention layer's out_proj)
    post_norm: torch.Tensor
    gate_up: nn.Module | None  # a dense MLP's; None in a mixture-of-experts layer
    down: nn.Module | None
    act: nn.Module | None
    experts: MixtureOfExperts | None = None  # a mixture-of-experts layer's router and experts
    in_proj: tuple[nn.Module, nn.Module] | None = None  # a linear-attention layer's (Qwen3.5): q/k/v/z, b/a
    mixer: DeltaNetMixer | None = None  # and its token mixer


@dataclass
class VisionRows:
    """Rows of a call that hold pictures or video frames: their features replace the placeholders'
    embeddings, and feature k of `deepstack` is added after decoder layer k (Qwen3-VL's DeepStack)."""

    rows: torch.Tensor  # indices into the call's rows
    features: VisionFeatures


@dataclass
class Rows:
    """One sequence's part of a call: `count` consecutive rows, its KV cache, its vision rows."""

    cache: object  # a GrowingCache (service/model/kv.py) or HybridCache (hybrid.py): extended in place by these rows
    count: int
    vision: list[VisionRows] = field(default_factory=list)
    undoable: bool = False  # a decode step's guesses: a hybrid cache can take the rejected ones back


class TextForward:
    """`forward(ids, positions, sequences, logits_rows)`: see the module docstring."""

    def __init__(self, model, attention):
        lm = model.model.language_model
        config = lm.config
        self.model_config = model.config
        self.layer_types = list(config.layer_types) if is_hybrid(config) else None
        self.embed_tokens = lm.embed_tokens
        self.lm_head = model.lm_head
        self.hidden = config.hidden_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        if not attention.supports(self.head_dim):
            log.warning("the attention kernel cannot take heads of %d: one SDPA call per prompt token", self.head_dim)
            attention = TorchAttention()
        self.attention = attention
        self.inv_freq = rotary_frequencies(config)
        self.rope_scaling = lm.rotary_emb.attention_scaling
        self.axis_of_frequency = _mrope_axes(lm.rotary_emb.mrope_section, len(self.inv_freq))
        self.rotated = 2 * len(self.inv_freq)  # Qwen3.5 rotates the first quarter of each head only
        # Qwen3.5's RMSNorms scale by 1 + weight (zero-centred weights); its attention gates its output
        self.gated = self.layer_types is not None
        self.final_norm = self.norm_scale(lm.norm.weight)
        self.shape = Shape.of(config) if self.gated else None
        self.layers = [self.layer_of(layer) for layer in lm.layers]
        self.mixers = [layer.mixer for layer in self.layers if layer.mixer is not None]
        self._qk_width = (self.heads + self.kv_heads) * self.head_dim

    def norm_scale(self, weight: torch.Tensor) -> torch.Tensor:
        """The scale an RMSNorm of this model multiplies by, from its checkpoint weight: the weight,
        or Qwen3.5's zero-centred 1 + weight (fp32)."""
        return _centred(weight) if self.gated else weight

    def norm(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each row of `x` (hidden wide), times `scale` (norm_scale's)."""
        return float_ops.rms_norm(x, scale, self.eps)

    def layer_of(self, layer: nn.Module) -> _Layer:
        """A decoder layer's weights as the forward computes them (a multi-token prediction head's
        layer too: service/model/mtp.py)."""
        common = dict(
            input_norm=self.norm_scale(layer.input_layernorm.weight),
            post_norm=self.norm_scale(layer.post_attention_layernorm.weight),
        )
        if hasattr(layer, "linear_attn"):
            attn = layer.linear_attn
            mixer = DeltaNetMixer(attn, self.shape, self.eps)
            return _Layer(
                qkv=None,
                qk_norm=None,
                o_proj=attn.out_proj,
                in_proj=(attn.in_proj_qkvz, attn.in_proj_ba),
                mixer=mixer,
                **common,
                **_mlp(layer.mlp),
            )
        attn = layer.self_attn
        qk_norm = torch.cat(
            [
                self.norm_scale(attn.q_norm.weight).expand(self.heads, -1),
                self.norm_scale(attn.k_norm.weight).expand(self.kv_heads, -1),
            ]
        )
        return _Layer(qkv=attn.qkv_proj, qk_norm=qk_norm, o_proj=attn.o_proj, **common, **_mlp(layer.mlp))

    def new_cache(self, dtype: torch.dtype, draft: bool = False) -> GrowingCache | HybridCache:
        """An empty cache for one sequence, keys and values stored in `dtype` (a hybrid model's
        recurrent states in fp32); with `draft`, room for a multi-token prediction head's keys and
        values and for what it is yet to read (service/model/mtp.py)."""
        if self.layer_types is not None:
            cache = HybridCache(self.layer_types, self.shape, dtype)
            cache.mixers = self.mixers
            if draft:
                cache.draft = DraftCache(dtype)
            return cache
        return GrowingCache(config=self.model_config, dtype=dtype)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (rows × 1 × head_dim) at each row's M-RoPE position (3 × rows: time,
        height, width), as transformers computes them: each frequency takes its axis's position
        (interleaved M-RoPE); the sign of sin's first half folds rotate_half's negation in."""
        freqs = positions[self.axis_of_frequency, torch.arange(positions.shape[1])[:, None]].float() * self.inv_freq
        cos, sin = float_ops.cos_sin(freqs)
        cos, sin = cos * self.rope_scaling, sin * self.rope_scaling
        return torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x·cos + rotate_half(x)·sin, rotate_half(x) = (-x2, x1): the same products, one roll — over
        the rotated part of each head (all of it but in Qwen3.5), the rest passed as it is."""
        if self.rotated == x.shape[-1]:
            return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
        part = x[..., : self.rotated]
        return torch.cat([part * cos + part.roll(self.rotated // 2, -1) * signed_sin, x[..., self.rotated :]], -1)

    @torch.inference_mode()
    def __call__(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        sequences: list[Rows],
        logits_rows: torch.Tensor | None = None,
        hidden: bool = False,
    ) -> torch.Tensor:
        """Logits (len(logits_rows) × vocab; every row's if None) after feeding `token_ids` (rows)
        at M-RoPE `positions` (3 × rows, or rows when all three axes agree, as after the prompt):
        `sequences` take consecutive rows, in order, and each one's cache grows by its rows — a
        cache with a multi-token prediction head's part (`draft`) also takes every row's final
        hidden state and input embedding, what the head reads (service/model/mtp.py). `hidden`: those
        rows' final-normed hidden states instead (what an embedding model pools), no lm_head."""
        rows = len(token_ids)
        if sum(s.count for s in sequences) != rows:
            raise ValueError("the sequences' rows do not add up to the rows given")
        if positions.dim() == 1:
            positions = positions.expand(3, rows)
        x = self.embed_tokens(token_ids)
        # vision rows of the whole call: placeholders' embeddings replaced by the features
        offsets = _offsets(sequences)
        vision = [(v.rows + offset, v.features) for offset, s in zip(offsets, sequences) for v in s.vision]
        for index, features in vision:
            x[index] = features.pooler.to(x.dtype)
        inputs = x  # the layers below make new tensors: these rows stay the call's input embeddings
        cos, sin = self.rotary(positions)
        for s in sequences:  # a hybrid cache recomputes with them when a decode step's guesses are taken back
            if isinstance(s.cache, HybridCache):
                s.cache.mixers = self.mixers
        counts, undoable = [s.count for s in sequences], [s.undoable for s in sequences]
        for i, layer in enumerate(self.layers):
            x = self.decoder_layer(layer, x, cos, sin, [s.cache.layers[i] for s in sequences], counts, undoable)
            for index, features in vision:
                if i < len(features.deepstack):
                    x[index] = x[index] + features.deepstack[i].to(x.dtype)
        drafts = [(offset, s) for offset, s in zip(offsets, sequences) if getattr(s.cache, "draft", None) is not None]
        if not drafts:
            x = self.norm(x if logits_rows is None else x[logits_rows], self.final_norm)
            return x if hidden else self.lm_head(x)
        x = self.norm(x, self.final_norm)  # every row's: the head reads them all
        for offset, s in drafts:
            rows_of = slice(offset, offset + s.count)
            s.cache.draft.fed(x[rows_of], inputs[rows_of], positions[:, rows_of])
        x = x if logits_rows is None else x[logits_rows]
        return x if hidden else self.lm_head(x)

    def decoder_layer(
        self,
        layer: _Layer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list,
        counts: list[int],
        undoable: list[bool] | None = None,
    ) -> torch.Tensor:
        """One decoder layer over the call's rows `x`: `counts[i]` consecutive rows for sequence i,
        whose keys and values (or recurrent state) `caches[i]` holds and takes."""
        h = self.norm(x, layer.input_norm)
        if layer.mixer is not None:  # linear attention: each sequence's state advanced by its rows
            undoable = undoable or [False] * len(counts)
            mixed = layer.mixer(caches, layer.in_proj[0](h), layer.in_proj[1](h), counts, undoable)
            x = x + layer.o_proj(mixed)
        else:
            x = x + layer.o_proj(self._attend(layer, h, cos, sin, caches, counts))
        h = self.norm(x, layer.post_norm)
        if layer.experts is not None:
            return x + layer.experts(h)
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        return x + layer.down(float_ops.silu_mul(gate, up))  # the bits of layer.act(gate) * up

    def _attend(self, layer, h, cos, sin, caches, counts) -> torch.Tensor:
        """Full attention of one layer for the call's rows: each sequence's queries over its own keys."""
        rows = len(h)
        qkv = layer.qkv(h)
        if self.gated:  # Qwen3.5: each head's query beside its gate, then the keys and values
            width = 2 * self.heads * self.head_dim
            query_gate = qkv[:, :width].view(rows, self.heads, 2, self.head_dim)
            keys = qkv[:, width : width + self.kv_heads * self.head_dim].view(rows, self.kv_heads, self.head_dim)
            qk = torch.cat([query_gate[:, :, 0], keys], 1)
            v = qkv[:, width + self.kv_heads * self.head_dim :].view(rows, self.kv_heads, self.head_dim)
        else:  # q and k heads side by side already: normed and rotated in one call each
            qk = qkv[:, : self._qk_width].view(rows, self.heads + self.kv_heads, self.head_dim)
            v = qkv[:, self._qk_width :].view(rows, self.kv_heads, self.head_dim)
        qk = self._rotate(float_ops.rms_norm(qk, None, self.eps) * layer.qk_norm, cos, sin)
        attended = torch.empty(rows, self.heads, self.head_dim)
        lo = 0
        for cache, count in zip(caches, counts):
            hi, start = lo + count, cache.get_seq_length()
            keys, values = cache.update(qk[lo:hi, self.heads :].transpose(0, 1)[None], v[lo:hi].transpose(0, 1)[None])
            self.attention(qk[lo:hi, : self.heads], keys, values, start, attended[lo:hi])
            lo = hi
        out = attended.view(rows, -1)
        if self.gated:
            out = out * float_ops.sigmoid(query_gate[:, :, 1].reshape(rows, -1))
        return out


def _mlp(mlp: nn.Module) -> dict:
    """A layer's MLP as `_Layer` holds it: a dense one's fused Linears (and SiLU, the only activation of
    these checkpoints, in fixed order), or a mixture of experts."""
    if is_moe_block(mlp):
        return dict(gate_up=None, down=None, act=None, experts=MixtureOfExperts(mlp))
    return dict(gate_up=mlp.gate_up_proj, down=mlp.down_proj, act=float_ops.Activation(float_ops.SILU))


def rotary_frequencies(config) -> torch.Tensor:
    """M-RoPE's inverse frequencies, 1 / theta^(2i/d) for the rotated dimensions d, computed in double
    and rounded: transformers computes them with torch's float pow, whose bits follow the CPU."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(dim * rope.get("partial_rotary_factor", 1.0))
    theta = float(rope["rope_theta"])
    return torch.tensor([1.0 / theta ** (i / dim) for i in range(0, dim, 2)], dtype=torch.float32)


def _centred(weight: torch.Tensor) -> torch.Tensor:
    """A zero-centred RMSNorm's scale (Qwen3.5's): 1 + weight, in fp32."""
    return 1.0 + weight.float()


def _offsets(sequences: list[Rows]) -> list[int]:
    """The first row of each sequence in the call."""
    offsets, at = [], 0
    for s in sequences:
        offsets.append(at)
        at += s.count
    return offsets


def _mrope_axes(section: list[int], frequencies: int) -> torch.Tensor:
    """The M-RoPE axis (0 time, 1 height, 2 width) of each rotary frequency, interleaved as
    transformers' `recomposition_frequencies`: height every third from 1, width every third from 2,
    within 3 × their sections; time elsewhere."""
    axes = torch.zeros(frequencies, dtype=torch.long)
    for axis in (1, 2):
        axes[axis : section[axis] * 3 : 3] = axis
    return axes
