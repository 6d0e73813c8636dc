"""Projections that share an input, computed as one Linear: q/k/v per attention, gate/up per MLP.

A decode step then makes 4 Linear calls per decoder layer instead of 7 (each call reads its
weights once and pays a fixed overhead). Every output row keeps its own weights and scale (INT8
scales are per output channel, activations per token), so the math per output is unchanged.
The modules keep transformers' forward signatures: the model's own forward runs them.

A mixture-of-experts layer (Qwen3-VL-MoE) keeps its experts as two 3-D tensors; here each expert
becomes two Linears (`ExpertLinears`: its gate/up, already one, and its down), which INT8 and
4-bit quantize as any other, so an expert's rows are computed by the same per-row kernels. The
router (`mlp.gate`) stays as it is: a float matrix (service/model/moe.py computes it).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def _fused_classes() -> tuple[type, type]:
    """(FusedTextAttention, FusedTextMLP): transformers' modules with fused projections, made on first
    use — importing transformers' modeling code costs seconds, and serving never needs it (the service
    builds its own modules: service/model/skeleton.py); `quantize`, `make-model` and the tests do."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (
        Qwen3VLTextAttention,
        Qwen3VLTextMLP,
        apply_rotary_pos_emb,
        eager_attention_forward,
    )

    class FusedTextAttention(Qwen3VLTextAttention):
        """Qwen3VLTextAttention.forward with q, k and v from one `qkv_proj`."""

        def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, self.head_dim)
            q, k, v = self.qkv_proj(hidden_states).split(self.split_sizes, dim=-1)
            query_states = self.q_norm(q.view(hidden_shape)).transpose(1, 2)
            key_states = self.k_norm(k.view(hidden_shape)).transpose(1, 2)
            value_states = v.view(hidden_shape).transpose(1, 2)
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
            if cache is not None:
                key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
            if self.config._attn_implementation == "sdpa":
                out, weights = self._sdpa(query_states, key_states, value_states, attention_mask), None
            else:
                attention = ALL_ATTENTION_FUNCTIONS.get_interface(
                    self.config._attn_implementation, eager_attention_forward
                )
                out, weights = attention(
                    self,
                    query_states,
                    key_states,
                    value_states,
                    attention_mask,
                    dropout=0.0,
                    scaling=self.scaling,
                    **kwargs,
                )
            return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

        def _sdpa(self, query, key, value, mask):
            """transformers' sdpa attention, with grouped query heads given to SDPA as such (enable_gqa)
            even under a mask, where transformers copies every key and value head per query head first
            (`repeat_kv`): the same result, measured 25 % faster for a 64-token prefill piece after
            3,072 cached tokens, without a 2x copy of the context's keys and values per layer."""
            causal = query.shape[2] > 1 and mask is None
            if causal and key.shape[2] > query.shape[2]:  # SDPA's causal mask is top-left aligned
                raise ValueError("a causal piece after cached tokens needs an explicit mask")
            out = F.scaled_dot_product_attention(
                query.to(key.dtype),
                key,
                value,
                attn_mask=mask,
                is_causal=causal,
                scale=self.scaling,
                enable_gqa=self.num_key_value_groups > 1,
            )
            return out.transpose(1, 2).to(query.dtype)  # a bf16 cache (KV_DTYPE): attention in bf16

    class FusedTextMLP(Qwen3VLTextMLP):
        """Qwen3VLTextMLP.forward with gate and up from one `gate_up_proj`."""

        def forward(self, x):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self.act_fn(gate) * up)

    return FusedTextAttention, FusedTextMLP


class ExpertLinears(nn.Module):
    """A layer's experts as Linears: `gate_up[e]` (hidden → 2·width, gate rows then up rows, as
    transformers' `gate_up_proj[e]`) and `down[e]` (width → hidden). `forward` is transformers'
    experts forward (each expert over its rows, weighted outputs added in expert order), for the
    model's own forward; the service's forward groups and adds them its own way (service/model/moe.py)."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.num_experts = experts.num_experts
        self.act_fn = experts.act_fn
        self.gate_up = nn.ModuleList(_linear(w) for w in experts.gate_up_proj.detach())
        self.down = nn.ModuleList(_linear(w) for w in experts.down_proj.detach())

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token, rank = torch.where(top_k_index == expert)
            gate, up = self.gate_up[expert](hidden_states[token]).chunk(2, dim=-1)
            y = self.down[expert](self.act_fn(gate) * up) * top_k_weights[token, rank, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def _linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free Linear whose weight is `weight` (out × in; a view, meta stays meta)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def is_moe_block(mlp: nn.Module) -> bool:
    """Whether a decoder layer's MLP is a mixture of experts (a router `gate` and `experts`)."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def model_class(config):
    """transformers' class for a config: Qwen3-VL or Qwen3.5, the dense model or the mixture of experts."""
    import transformers

    names = {
        "qwen3_vl": "Qwen3VLForConditionalGeneration",
        "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
        "qwen3_5": "Qwen3_5ForConditionalGeneration",
        "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    }
    model_type = getattr(config, "model_type", None)
    if model_type not in names:
        raise ValueError(f"model_type {model_type!r}: this service serves {', '.join(names)}")
    return getattr(transformers, names[model_type])


def text_layers(model) -> list[tuple[str, nn.Module]]:
    """(name, module) of each text decoder layer."""
    names = {id(m): n for n, m in model.named_modules()}
    return [(names[id(layer)], layer) for layer in model.model.language_model.layers]


def _concatenated(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the linears' outputs side by side (meta weights stay meta)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    fused = nn.Linear(
        weight.shape[1], weight.shape[0], bias=linears[0].bias is not None, device=weight.device, dtype=weight.dtype
    )
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False)
    return fused


def fuse_projections(model) -> None:
    """Replace every text layer's q/k/v and gate/up Linears by fused ones, and a mixture of experts'
    3-D expert tensors by `ExpertLinears`, in place (one layer's projections are copied at a time).
    Works on a meta-device skeleton too."""
    for _, layer in text_layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        attn.split_sizes = [p.out_features for p in parts]
        attn.qkv_proj = _concatenated(parts)
        del attn.q_proj, attn.k_proj, attn.v_proj
        attn.__class__ = _fused_classes()[0]
        if is_moe_block(mlp):
            mlp.experts = ExpertLinears(mlp.experts)
            continue
        mlp.gate_up_proj = _concatenated([mlp.gate_proj, mlp.up_proj])
        del mlp.gate_proj, mlp.up_proj
        mlp.__class__ = _fused_classes()[1]
