"""The model's structure as quantization sees it: transformers' model of a config on the meta device
(`skeleton`), the units quantized at once (`quantization_blocks`), their Linears, the input embedding,
and a module or tensor replaced by name — what quantizing in place, the checkpoint writer, the size
estimates and the loader share.
"""

from __future__ import annotations

import torch
from torch import nn

from ..native import float_ops
from .fusion import model_class


def quantization_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each unit quantized at once: vision blocks, mergers, decoder layers, lm_head."""
    names = {id(m): n for n, m in model.named_modules()}
    visual = model.model.visual
    blocks = [
        *visual.blocks,
        visual.merger,
        *getattr(visual, "deepstack_merger_list", []),
        *model.model.language_model.layers,
        model.lm_head,
    ]
    return [(names[id(b)], b) for b in blocks]


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
    """The model with every parameter on the meta device (no memory) and real rotary buffers."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return model_class(config)(config)
