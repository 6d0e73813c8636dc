"""The model's structure as quantization sees it: transformers' model of a config on the meta device
(`skeleton`), the units quantized at once (`quantization_blocks`), their Linears, the input embedding,
and a module or tensor replaced by name — what quantizing in place, the checkpoint writer, the size
estimates and the loader share.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..native import float_ops
from .fusion import model_class

log = logging.getLogger(__name__)


def quantization_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each unit quantized at once: vision blocks, mergers, decoder layers, a
    multi-token prediction head's fc and decoder layer (Qwen3.5's `mtp`), lm_head."""
    names = {id(m): n for n, m in model.named_modules()}
    visual = model.model.visual
    head = getattr(model, "mtp", None)
    blocks = [
        *visual.blocks,
        visual.merger,
        *getattr(visual, "deepstack_merger_list", []),
        *model.model.language_model.layers,
        *([head.fc, *head.layers] if head is not None else []),
        model.lm_head,
    ]
    return [(names[id(b)], b) for b in blocks]


def drop_absent_head(model: nn.Module) -> None:
    """A model built with a multi-token prediction head (`mtp`) whose checkpoint holds none of its
    tensors (a copy that left them out, a quantized one written before heads were kept) goes without
    it; a head with only some tensors missing stays, refused by name as any incomplete checkpoint."""
    head = getattr(model, "mtp", None)
    if head is not None and all(t.is_meta for t in head.parameters()):
        log.info("the checkpoint holds no multi-token prediction head (mtp.*) although its config names one")
        model.mtp = None


# Linears kept as float matrices: Qwen3.5's shared-expert gate, one row the router's kernel computes beside its own
FLOAT_LINEARS = ("shared_expert_gate",)
# What quantizing takes as a Linear: torch's, or a loaded fp32 model's fixed-order one (its weight unpacked)
LINEARS = (nn.Linear, float_ops.Linear)


def linear_names(name: str, block: nn.Module) -> list[str]:
    """The Linears of `block` (named `name`) that are quantized."""
    return [
        f"{name}.{n}" if n else name
        for n, m in block.named_modules()
        if isinstance(m, LINEARS) and not n.endswith(FLOAT_LINEARS)
    ]


def embedding_name(model: nn.Module) -> str:
    embed = model.get_input_embeddings()
    return next(n for n, m in model.named_modules() if m is embed)


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    parent, _, attr = name.rpartition(".")
    module = model.get_submodule(parent) if parent else model
    if attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)


def skeleton(config) -> nn.Module:
    """The model with every parameter on the meta device (no memory) and real rotary buffers, and a
    Qwen3.5 checkpoint's multi-token prediction head, which transformers does not build (`mtp`)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = model_class(config)(config)
        text = getattr(config, "text_config", config)
        if getattr(text, "mtp_num_hidden_layers", 0) and "full_attention" in (getattr(text, "layer_types", None) or []):
            model.mtp = _head_of(model, text)
    return model


def _head_of(model: nn.Module, text) -> nn.Module:
    """Qwen3.5's `mtp` module as its checkpoints store it (vLLM's reading): `fc` (2·hidden → hidden),
    `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `mtp_num_hidden_layers` full-attention decoder
    layers of the model's own kind, and `norm` — built of transformers' classes for the model's."""
    decoder = model.model.language_model
    full = text.layer_types.index("full_attention")
    layer, norm = type(decoder.layers[full]), type(decoder.norm)
    head = nn.Module()
    head.fc = nn.Linear(2 * text.hidden_size, text.hidden_size, bias=False)
    head.pre_fc_norm_embedding = norm(text.hidden_size, eps=text.rms_norm_eps)
    head.pre_fc_norm_hidden = norm(text.hidden_size, eps=text.rms_norm_eps)
    head.layers = nn.ModuleList(layer(text, full) for _ in range(text.mtp_num_hidden_layers))
    head.norm = norm(text.hidden_size, eps=text.rms_norm_eps)
    return head
