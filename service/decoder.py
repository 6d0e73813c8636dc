"""The decode step: one new token for each of B sequences through the Qwen3-VL text decoder.

It computes what transformers' forward computes for a decode step — the same weights, modules
and config, read from the loaded model — without its per-layer Python machinery: no masks (each
sequence attends to exactly its own cache, so there is no padding to hide), rotary cos/sin made
once per step for every layer, RMSNorm as one fused call, keys and values appended in place
(service/kv.py), four Linear calls per layer (service/fusion.py).

Positions: a token after the prompt has the same M-RoPE position on its three axes (time,
height, width), `index + rope_delta`, so its rotary angles are plain RoPE at that position.
Attention per sequence, against its own keys and values: the query heads that share a key/value
head go in as that head's query rows (transformers' `pack_gqa`), so each key and value is read
once per step (SDPA's enable_gqa reads them once per query head: 1.45x slower at 3,072 tokens
here); a sequence's result does not depend on its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: nn.Module
    qk_norm: torch.Tensor  # (heads + kv_heads) × head_dim: q_norm's weight per query head, then k_norm's
    o_proj: nn.Module
    post_norm: torch.Tensor
    gate_up: nn.Module
    down: nn.Module
    act: nn.Module


class DecodeStep:
    """`step(token_ids, positions, caches) -> logits`: see the module docstring."""

    def __init__(self, model):
        lm = model.model.language_model
        config = lm.config
        self.embed = lm.embed_tokens
        self.lm_head = model.lm_head
        self.hidden = config.hidden_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.scaling = self.head_dim**-0.5
        self.inv_freq = lm.rotary_emb.inv_freq.float()
        self.rope_scaling = lm.rotary_emb.attention_scaling
        self.final_norm = lm.norm.weight
        self.layers = [
            _Layer(
                input_norm=layer.input_layernorm.weight,
                qkv=layer.self_attn.qkv_proj,
                qk_norm=torch.cat(
                    [
                        layer.self_attn.q_norm.weight.expand(self.heads, -1),
                        layer.self_attn.k_norm.weight.expand(self.kv_heads, -1),
                    ]
                ),
                o_proj=layer.self_attn.o_proj,
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=layer.mlp.gate_up_proj,
                down=layer.mlp.down_proj,
                act=layer.mlp.act_fn,
            )
            for layer in lm.layers
        ]
        self._qk_width = (self.heads + self.kv_heads) * self.head_dim

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (B × 1 × head_dim) at each sequence's position, as transformers computes
        them; the sign of sin's first half folds rotate_half's negation in (see `_rotate`)."""
        freqs = positions[:, None].float() * self.inv_freq
        cos, sin = freqs.cos() * self.rope_scaling, freqs.sin() * self.rope_scaling
        return torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x·cos + rotate_half(x)·sin, rotate_half(x) = (-x2, x1): the same products, one roll."""
        return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin

    @torch.inference_mode()
    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, caches: list) -> torch.Tensor:
        """Logits (B × vocab) after feeding token_ids[b] at positions[b] to the sequence whose KV
        cache is caches[b]; each cache grows by that token."""
        batch = len(caches)
        group = self.heads // self.kv_heads
        x = self.embed(token_ids)
        cos, sin = self.rotary(positions)
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, (self.hidden,), layer.input_norm, self.eps)
            qkv = layer.qkv(h)
            # q and k heads normed and rotated in one go: one call each instead of two
            qk = qkv[:, : self._qk_width].view(batch, self.heads + self.kv_heads, self.head_dim)
            qk = self._rotate(F.rms_norm(qk, (self.head_dim,), eps=self.eps) * layer.qk_norm, cos, sin)
            q, k = qk[:, : self.heads], qk[:, self.heads :]
            v = qkv[:, self._qk_width :].view(batch, self.kv_heads, self.head_dim)
            attended = []
            for b, cache in enumerate(caches):
                keys, values = cache.layers[i].update(k[b : b + 1, :, None], v[b : b + 1, :, None])
                query = q[b].view(1, self.kv_heads, group, self.head_dim).to(keys.dtype)  # a bf16 cache: bf16 math
                out = F.scaled_dot_product_attention(query, keys, values, scale=self.scaling)
                attended.append(out.reshape(1, -1).float())
            x = x + layer.o_proj(attended[0] if batch == 1 else torch.cat(attended))
            h = F.rms_norm(x, (self.hidden,), layer.post_norm, self.eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(layer.act(gate) * up)
        return self.lm_head(F.rms_norm(x, (self.hidden,), self.final_norm, self.eps))
