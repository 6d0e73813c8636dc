"""INT8 layers: Linear with per-token activation quantization, the memory-mapped fallback, the embedding.

`Int8Linear` keeps torch's FBGEMM kernels and their packed int8 weights (symmetric, one scale
per output channel) but quantizes its input **per row**: each row is divided by its own absolute
maximum and quantized with a fixed scale, and its output is multiplied back. A row's result so
never depends on the other rows of the call — the same bits alone, in a prefill piece of any
length or in a decode batch, and a huge activation on one token (real checkpoints have such
spikes) costs only that token precision. torch's own dynamic Linear scales the whole input
tensor with one factor instead; it remains here as `activations="per_tensor"` for comparisons.

The fixed scale is 2**-6 with zero point 64: a row becomes uint8 values in [0, 128]. A power of
two makes the kernel's own rounding (multiply or divide by the scale) exact either way, and at
most 128 keeps every u8×s8 pair sum within int16 (2·128·128 = 32768 at -128), so CPUs without
VNNI, whose `vpmaddubsw` saturates there, compute the same bits as those with it.
"""

from __future__ import annotations

import torch
from torch import nn

ACTIVATION_SCALE = 2.0 ** -6
ACTIVATION_ZERO_POINT = 64
ACTIVATIONS = ("per_token", "per_tensor")
ROWS_PER_CHUNK = 16384  # per-row quantization is exact in chunks: the 151936-row embedding never goes fp32 whole
GEMV_ROWS = 4  # MappedInt8Linear: up to this many tokens use the int8 GEMV kernel (decode)
MAPPED_SLICE = 4096  # MappedInt8Linear: output rows dequantized at once for prefill (bounded scratch memory)
_TINY = torch.finfo(torch.float32).tiny


def int8_qconfig():
    """The weight quantization both paths use: int8, symmetric per output channel."""
    from torch.ao.quantization import per_channel_dynamic_qconfig

    return per_channel_dynamic_qconfig


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows and fp32 per-row scales (torch's per-channel observer and rounding)."""
    from torch.ao.nn.quantized.modules.utils import _quantize_weight

    rows, scales = [], []
    for start in range(0, weight.shape[0], ROWS_PER_CHUNK):
        chunk = weight[start:start + ROWS_PER_CHUNK].float()
        observer = int8_qconfig().weight()
        observer(chunk)
        q = _quantize_weight(chunk, observer)
        rows.append(q.int_repr())
        scales.append(q.q_per_channel_scales().float())
        del chunk, q
    return (rows[0], scales[0]) if len(rows) == 1 else (torch.cat(rows), torch.cat(scales))


def empty_qweight(shape: tuple[int, int], scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An uninitialised per-row qint8 weight, and an int8 view of its memory to fill it through."""
    qweight = torch._empty_per_channel_affine_quantized(
        shape, scales=scales.double(), zero_points=torch.zeros(shape[0], dtype=torch.long), axis=0, dtype=torch.qint8)
    rows = torch.empty(0, dtype=torch.int8).set_(qweight.untyped_storage(), 0, shape, (shape[1], 1))
    return qweight, rows


class Int8Linear(nn.Module):
    """A Linear on FBGEMM's packed int8 weights, activations quantized per row (see the module docstring)."""

    def __init__(self, qweight: torch.Tensor, bias: torch.Tensor | None, activations: str = "per_token"):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}")
        self.out_features, self.in_features = qweight.shape
        self.activations = activations
        # Packed without the bias: per-token outputs are scaled back first, then the bias is added.
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_float(cls, linear: nn.Linear, activations: str = "per_token") -> "Int8Linear":
        rows, scales = quantize_rows(linear.weight.detach())
        qweight, view = empty_qweight(tuple(rows.shape), scales)
        view.copy_(rows)
        return cls(qweight, linear.bias, activations)

    def weight_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 rows, fp32 per-row scales): a copy of the packed weight."""
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qweight.int_repr(), qweight.q_per_channel_scales().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        if self.activations == "per_tensor":
            y = torch.ops.quantized.linear_dynamic(flat, self._packed, True)
        else:
            # max(|x|) per row; amax and amin read the row without an |x| temporary (5x faster than vector_norm)
            peak = torch.maximum(flat.amax(-1, keepdim=True), flat.amin(-1, keepdim=True).neg_()).clamp_min_(_TINY)
            y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                flat / peak, ACTIVATION_SCALE, ACTIVATION_ZERO_POINT, self._packed).mul_(peak)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, {self.activations} activations"


class MappedInt8Linear(nn.Module):
    """Int8 Linear computing from memory-mapped weights (weight-only int8, fp32 activations).

    Used when the packed model would not fit MAX_MEMORY_MB: nothing is copied, so the kernel can
    drop the weight pages under pressure and read them back from disk; slower than the packed kernel.
    A fused projection is several mapped parts whose outputs are concatenated.
    """

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor]], bias: torch.Tensor | None):
        super().__init__()
        self.in_features = parts[0][0].shape[1]
        self.out_features = sum(rows.shape[0] for rows, _ in parts)
        for i, (rows, scales) in enumerate(parts):
            self.register_buffer(f"rows{i}", rows)
            self.register_buffer(f"scales{i}", scales.float())
        self.parts = len(parts)
        self.register_buffer("bias", None if bias is None else bias.float())

    def _part(self, flat: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if flat.shape[0] <= GEMV_ROWS:
            return torch._weight_int8pack_mm(flat, rows, scales)
        # that kernel is very slow for many rows: dequantize a slice of the weight at a time
        return torch.cat([nn.functional.linear(flat, rows[i:i + MAPPED_SLICE].float() * scales[i:i + MAPPED_SLICE, None])
                          for i in range(0, rows.shape[0], MAPPED_SLICE)], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()
        outs = [self._part(flat, getattr(self, f"rows{i}"), getattr(self, f"scales{i}")) for i in range(self.parts)]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


class Int8Embedding(nn.Module):
    """Embedding lookup from int8 rows and per-row scales, dequantized for the looked-up ids only."""

    def __init__(self, rows: torch.Tensor, scales: torch.Tensor, padding_idx: int | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = rows.shape
        self.padding_idx = padding_idx
        self.register_buffer("rows", rows)
        self.register_buffer("scales", scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows[ids].float() * self.scales[ids].unsqueeze(-1)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 rows"


def set_activations(model: nn.Module, activations: str) -> None:
    """Switch every Int8Linear of `model` to `activations` (the same packed weights): for the
    benchmarks and tests that compare per-token with per-tensor quantization in one process."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}")
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.activations = activations
