"""The Qwen3-VL vision tower, the service's own: pixel patches → pooled features and DeepStack features.

It mirrors transformers' `Qwen3VLVisionModel` (and `Qwen3VLMoeVisionModel`, the same tower) without
importing transformers' modeling code (~5 s of every start): the same submodule, parameter and buffer
names and shapes (a checkpoint's `model.visual.*` tensors load 1:1, strict), and the same operations in
the same order as transformers computes with `attn_implementation="sdpa"` on the CPU — each of them in
one fixed order on every CPU (service/native/float_ops.py: the patch embedding as a fixed-order matrix
product, the LayerNorms, GELUs, rotary sin/cos, fp32 Linears and the attention), so the features are
the same bits on every instruction set and within float rounding of transformers'.
tests/test_vision_tower.py checks both.

The forward itself is service/vision/steps.py's `_tower_steps` (one block per scheduler step); this
module holds the modules it calls. Linears are called as `linear(x)`, never through their weights,
because the service swaps them for its INT8 / 4-bit Linears after construction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..native import float_ops
from .features import VisionFeatures
from .steps import _tower_steps, run_to_end

# transformers' ACT2FN for the names Qwen3-VL's vision configs use: F.gelu, parameter-free, in fixed order here.
ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda: float_ops.Activation(float_ops.GELU_TANH),
    "gelu": lambda: float_ops.Activation(float_ops.GELU_ERF),
}


def activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(f"vision activation {name!r}: this service computes {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]()


class PatchEmbed(nn.Module):
    """Each flattened temporal × spatial patch through a Conv3d whose kernel is the patch: a matrix
    product of the flattened patches with the flattened kernel (float_ops' fixed-order GEMM, its
    weight packed on first use)."""

    def __init__(self, config):
        super().__init__()
        self.patch_size = config.patch_size
        self.temporal_patch_size = config.temporal_patch_size
        self.in_channels = config.in_channels
        self.embed_dim = config.hidden_size
        kernel = [self.temporal_patch_size, self.patch_size, self.patch_size]
        self.proj = nn.Conv3d(self.in_channels, self.embed_dim, kernel_size=kernel, stride=kernel, bias=True)
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None  # (the weight packed, the weight it was of)

    def packed(self) -> torch.Tensor:
        weight = self.proj.weight
        if self._packed is None or self._packed[1] is not weight:
            self._packed = (float_ops.pack(weight.reshape(self.embed_dim, -1)), weight)
        return self._packed[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.proj.weight.dtype == torch.float32 and float_ops.available():
            flat = x.reshape(-1, self.proj.weight[0].numel()).float()
            return float_ops.gemm(flat, self.packed(), self.embed_dim, self.proj.bias)
        x = x.view(-1, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size)
        return self.proj(x.to(dtype=self.proj.weight.dtype)).view(-1, self.embed_dim)


class RotaryEmbedding(nn.Module):
    """Axial 2-D RoPE: the same frequencies for rows and columns, a quarter of the head each, twice."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        if self.rope_type != "axial":
            raise ValueError(f"vision rope_type {self.rope_type!r}: this service computes axial rope only")
        self.attention_scaling = 1.0  # transformers multiplies by it; kept so the ops are the same
        inv_freq = self.frequencies()
        # Not in the checkpoint (non-persistent), so computed on the CPU even under torch.device("meta").
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def frequencies(self) -> torch.Tensor:
        """transformers' `compute_axial_rope_parameters`, on the CPU."""
        base = self.config.rope_parameters["rope_theta"]
        dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_heads
        spatial_dim = dim // 2
        return 1.0 / (base ** (torch.arange(0, spatial_dim, 2, dtype=torch.float, device="cpu") / spatial_dim))

    def reset_buffers(self) -> None:
        inv_freq = self.frequencies()
        self.inv_freq = inv_freq
        self.original_inv_freq = inv_freq.clone()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: tokens × 2 (row, column)
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        cos, sin = float_ops.cos_sin(freqs)  # in double: torch's sin and cos round by the CPU
        cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return self.recomposition_frequencies(cos), self.recomposition_frequencies(sin)

    @staticmethod
    def recomposition_frequencies(freq: torch.Tensor) -> torch.Tensor:
        """tokens × 2 × dim/4 → tokens × dim: (rows, columns, rows, columns)."""
        freq_hw = torch.cat([freq[:, 0], freq[:, 1]], dim=-1)
        return torch.cat([freq_hw, freq_hw], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' `apply_rotary_pos_emb_vision`: rotated in fp32, back in the inputs' dtype."""
    q_dtype, k_dtype = q.dtype, k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed.to(q_dtype), k_embed.to(k_dtype)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dim = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = self.dim // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.qkv = nn.Linear(self.dim, self.dim * 3, bias=True)
        self.proj = nn.Linear(self.dim, self.dim)

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, position_embeddings) -> torch.Tensor:
        seq_length = hidden.shape[0]
        qkv = self.qkv(hidden)
        cos, sin = position_embeddings
        # Each image (each frame of a video) attends within itself: float_ops' kernel, rotary included
        # (one chain per score and per output, the same bits on every CPU), or else torch's SDPA below.
        out = float_ops.vision_attention(qkv, cos, sin, cu_seqlens.tolist(), self.num_heads, self.scaling)
        if out is not None:
            return self.proj(out)
        q, k, v = qkv.reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = apply_rotary(q, k, cos, sin)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # 1 × heads × tokens × head_dim
        # transformers' non-flash path: one SDPA call per segment (no mask, not causal, no dropout).
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        segments = zip(*(torch.split(t, lengths, dim=2) for t in (q, k, v)))
        outputs = [
            F.scaled_dot_product_attention(qs, ks, vs, scale=self.scaling).transpose(1, 2).contiguous()
            for qs, ks, vs in segments
        ]
        out = torch.cat(outputs, dim=1).reshape(seq_length, -1).contiguous()
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.linear_fc1 = nn.Linear(self.hidden_size, self.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(self.intermediate_size, self.hidden_size, bias=True)
        self.act_fn = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = Attention(config)
        self.mlp = MLP(config)

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, position_embeddings, max_seqlen=None):
        # max_seqlen only matters to flash attention's kernels, which the CPU does not run.
        attended = self.attn(_norm(self.norm1, hidden), cu_seqlens=cu_seqlens, position_embeddings=position_embeddings)
        hidden = hidden + attended
        return hidden + self.mlp(_norm(self.norm2, hidden))


class PatchMerger(nn.Module):
    """Each 2 × 2 (spatial_merge_size²) block of tokens as one token of the text decoder's width; the
    DeepStack mergers normalise after gathering the block (`use_postshuffle_norm`), the last one before."""

    def __init__(self, config, use_postshuffle_norm: bool = False):
        super().__init__()
        self.hidden_size = config.hidden_size * (config.spatial_merge_size**2)
        self.use_postshuffle_norm = use_postshuffle_norm
        self.norm = nn.LayerNorm(self.hidden_size if use_postshuffle_norm else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden_size, self.hidden_size)
        self.act_fn = float_ops.Activation(float_ops.GELU_ERF)  # nn.GELU(), in fixed order
        self.linear_fc2 = nn.Linear(self.hidden_size, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _norm(self.norm, x.view(-1, self.hidden_size) if self.use_postshuffle_norm else x)
        x = x.view(-1, self.hidden_size)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


def _norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """A LayerNorm module's computation in fixed order (float_ops)."""
    return float_ops.layer_norm(x, norm.weight, norm.bias, norm.eps)


class VisionTower(nn.Module):
    """transformers' `Qwen3VLVisionModel` (the checkpoint's `model.visual`), from its vision config."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_size = config.patch_size
        self.spatial_merge_unit = self.spatial_merge_size * self.spatial_merge_size
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        # How the square learned position grid is resampled to each image's grid (transformers' values).
        self.num_grid_per_side = int(config.num_position_embeddings**0.5)
        self.interpolation_align_corners = True
        self.interpolation_mode = "bilinear"
        self.rotary_pos_emb = RotaryEmbedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, use_postshuffle_norm=False)
        # Qwen3.5's tower has no DeepStack: its config has no such indexes
        self.deepstack_visual_indexes = list(getattr(config, "deepstack_visual_indexes", None) or [])
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, use_postshuffle_norm=True) for _ in self.deepstack_visual_indexes
        )

    @property
    def dtype(self) -> torch.dtype:
        """What pixels are cast to (transformers' `visual.dtype`)."""
        return self.patch_embed.proj.weight.dtype

    def reset_buffers(self) -> None:
        """Recompute the non-persistent buffers (the rotary frequencies) on the CPU, e.g. after `to_empty`."""
        self.rotary_pos_emb.reset_buffers()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionFeatures:
        """Every image of `grid_thw` at once, unsplit: `pooler_output` and the DeepStack features."""
        return run_to_end(_tower_steps(self, pixel_values, grid_thw))

    def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[VisionFeatures]:
        """Per image, what transformers' `get_image_features` gives. The batch runs in one pass as there (a
        matrix product's bits may depend on how many rows it has), then is split per image."""
        features = self(pixel_values, image_grid_thw)
        sizes = (image_grid_thw.prod(-1) // self.spatial_merge_size**2).tolist()
        layers = [torch.split(layer, sizes) for layer in features.deepstack]
        return [
            VisionFeatures(pooler=pooler, deepstack=[layer[i] for layer in layers])
            for i, pooler in enumerate(torch.split(features.pooler, sizes))
        ]
