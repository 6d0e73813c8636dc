"""A checkpoint's size from its config alone (the model on the meta device): in its own dtype, or as
the writer (service/quant/writer.py) writes it INT8 or 4-bit — for a preset too large to write
first and measure (`make-model` refuses 30B-A3B in bf16 with these figures).
"""

from __future__ import annotations

import math

import torch

from .fusion import is_moe_block
from .int4_linear import group_for
from .packing import linear_groups
from .structure import embedding_name, linear_names, quantization_blocks, skeleton
from .writer import EXPERT_TENSORS, GROUP_SIZE, KEEP_8BIT


def estimated_bytes(
    config, bits: int | None, group_size: int = GROUP_SIZE, keep_8bit: tuple[str, ...] = KEEP_8BIT
) -> int:
    """The bytes of tensors a checkpoint of `config` holds, from its shapes alone (the model on the meta
    device): bits=None the checkpoint itself in its dtype (bf16 unless the config says otherwise);
    8 or 4 what `quantize` / `make-model --bits` write — per 4-bit weight half a byte plus a zero point
    (1 byte) and an fp16 scale per group (0.52 bytes a weight at group 128), per INT8 weight a byte
    plus a 4-byte scale per row, the embedding as int8 rows, every other tensor fp32. Files add
    their headers (a few kB each) to this."""
    model = skeleton(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    params = {n: math.prod(t.shape) for n, t in model.named_parameters(remove_duplicate=False)}
    if tied:
        params.pop("lm_head.weight", None)
    if bits is None:
        dtype = getattr(config, "dtype", None) or torch.bfloat16
        size = (dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))).itemsize
        return sum(params.values()) * size

    def four_bit(name: str, rows: int, inputs: int) -> int | None:
        group = group_for(inputs, group_size)
        if bits != 4 or name.startswith(tuple(keep_8bit)) or group is None:
            return None
        padded = -(-rows // 64) * 64  # the kernel's channel groups (int4_gemm.c)
        return padded * inputs // 2 + padded * (inputs // group) * 3 + 12

    total, counted = 0, set()
    embed_name = embedding_name(model)
    lm_head_int8 = False
    for name, block in quantization_blocks(model):
        linears = {n: model.get_submodule(n) for n in linear_names(name, block)}
        for fused, parts in linear_groups(list(linears)).items():
            rows = sum(linears[p].weight.shape[0] for p in parts)
            inputs = linears[parts[0]].weight.shape[1]
            bias = 4 * rows if linears[parts[0]].bias is not None else 0
            packed = four_bit(fused, rows, inputs)
            total += bias + (packed if packed is not None else _int8_bytes(rows, inputs))
            lm_head_int8 |= fused == "lm_head" and packed is None
            counted.update(f"{p}.{t}" for p in parts for t in ("weight", "bias"))
        mlp = getattr(block, "mlp", None)
        if mlp is not None and is_moe_block(mlp):
            for tensor, part in zip(EXPERT_TENSORS, ("gate_up", "down")):
                experts, rows, inputs = getattr(mlp.experts, tensor).shape
                packed = four_bit(f"{name}.mlp.experts.{part}.0", rows, inputs)
                total += experts * (packed if packed is not None else _int8_bytes(rows, inputs))
                counted.add(f"{name}.mlp.experts.{tensor}")
    vocab, hidden = model.get_submodule(embed_name).weight.shape
    if not (tied and lm_head_int8):  # else the lm_head's INT8 rows are the embedding
        total += vocab * hidden + 4 * vocab
    counted.add(f"{embed_name}.weight")
    return total + 4 * sum(n for name, n in params.items() if name not in counted)


def _int8_bytes(rows: int, inputs: int) -> int:
    """An INT8 Linear's bytes in format 2: its weights in the native layout (padded to groups of 32 rows
    and 4 inputs), a scale and a column sum per row, its shape."""
    return -(-rows // 32) * 32 * (-(-inputs // 4) * 4) + 8 * rows + 8
