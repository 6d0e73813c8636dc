"""INT8 in place: a loaded fp32 model's Linears become `Int8Linear`s one block at a time, its embedding
int8 rows (the tied lm_head's own) — QUANTIZATION=int8 on an ordinary checkpoint. These are the
`Int8Linear`s a pre-quantized checkpoint loads (service/quant/int8_linear.py: int8 weights symmetric
per output channel, activations quantized per token at run time), so both answer exactly alike.
"""

from __future__ import annotations

from torch import nn

from ..memory import release_memory
from .int8_linear import Int8Embedding, Int8Linear, quantize_rows
from .packing import kernel_of
from .structure import embedding_name, linear_names, quantization_blocks, replace_module


def quantize_in_place(
    model: nn.Module, activations: str = "per_token", int8_embedding: bool = True, kernel="fbgemm"
) -> None:
    """INT8-quantize every nn.Linear (`Int8Linear`) one block at a time (at most one block is fp32
    at once), and turn the embedding into int8 rows (the lm_head's when tied). The defaults are
    what the service and `quantize` use; the other choices exist for the fidelity benchmark."""
    embed_name = embedding_name(model)
    embed = model.get_submodule(embed_name)
    tied = model.lm_head.weight is embed.weight
    table = None
    for name, block in quantization_blocks(model):
        block.float()
        for linear in linear_names(name, block):
            module = model.get_submodule(linear)
            rows, scales = quantize_rows(module.weight.detach())
            if linear == "lm_head" and tied and int8_embedding:  # the same int8 rows serve as the embedding
                table = Int8Embedding(rows, scales, embed.padding_idx)
            replace_module(model, linear, Int8Linear(rows, scales, module.bias, activations, kernel_of(linear, kernel)))
        release_memory()
    if int8_embedding:
        replace_module(model, embed_name, table or Int8Embedding(*quantize_rows(embed.weight), embed.padding_idx))
    release_memory(full=True)
