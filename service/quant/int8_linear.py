"""INT8 layers: Linear with per-token activation quantization, the memory-mapped fallback, the embedding.

`Int8Linear` computes on packed int8 weights (symmetric, one scale per output channel) with one of
three kernels — torch's FBGEMM, torch's oneDNN, or the service's own (`native`: service/native/int8_gemm.c,
built for this CPU) — which give the same bits, so which one serves is a matter of speed only
(service/quant/kernel_choice.py measures them). It quantizes its input **per row**: each row is divided
by its own absolute maximum and quantized with a fixed scale, and its output is multiplied back. A row's result so
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

import ctypes
import functools
import logging
import math
from pathlib import Path

import torch
from torch import nn

from .. import native

log = logging.getLogger(__name__)

ACTIVATION_SCALE = 2.0**-6
ACTIVATION_ZERO_POINT = 64
ACTIVATIONS = ("per_token", "per_tensor")
KERNELS = ("fbgemm", "onednn", "native")
CHUNK_ELEMENTS = 1 << 21  # per-row quantization is exact in chunks: rows of 8 MiB in fp32 at a time
GEMV_ROWS = 4  # MappedInt8Linear, fp32: up to this many tokens use the int8 GEMV kernel (decode)
MAPPED_GEMV_ROWS = 16  # MappedInt8Linear, bf16: likewise (its vectorized path stays fast up to about here)
MAPPED_SLICE = 4096  # MappedInt8Linear: output rows dequantized at once for prefill (bounded scratch memory)
_TINY = torch.finfo(torch.float32).tiny


def int8_qconfig():
    """The weight quantization both paths use: int8, symmetric per output channel."""
    from torch.ao.quantization import per_channel_dynamic_qconfig

    return per_channel_dynamic_qconfig


def rows_per_chunk(shape) -> int:
    """Whole rows (along the first dimension of `shape`) that make about CHUNK_ELEMENTS: what per-row
    work (quantization, row sums, a checkpoint writer's reads) takes at once — bounded in bytes, not
    rows, so a wide Linear (a vision merger's 4608 columns) holds no more than the embedding's 2048."""
    return max(1, CHUNK_ELEMENTS // max(1, math.prod(shape[1:])))


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows and fp32 per-row scales (torch's per-channel observer and rounding)."""
    from torch.ao.nn.quantized.modules.utils import _quantize_weight

    rows, scales = [], []
    step = rows_per_chunk(weight.shape)
    for start in range(0, weight.shape[0], step):
        chunk = weight[start : start + step].float()
        observer = int8_qconfig().weight()
        observer(chunk)
        q = _quantize_weight(chunk, observer)
        rows.append(q.int_repr())
        scales.append(q.q_per_channel_scales().float())
        del chunk, q
    return (rows[0], scales[0]) if len(rows) == 1 else (torch.cat(rows), torch.cat(scales))


def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


_BF16_GEMM = " avx512_bf16" in _cpu_flags()


# int8_gemm.c's `Linear`: one call's input, weights and output
_NativeCall = native.linear_call("_NativeCall", (), ("packed", "column_sums", "scales"))


@functools.cache
def native_library() -> ctypes.CDLL:
    """int8_gemm.c built for this CPU, its functions typed (once per process: every native Linear asks)."""
    return native.typed_library(
        native.INT8_GEMM,
        {
            "int8_packed_bytes": ([ctypes.c_int, ctypes.c_int], ctypes.c_int64),
            "int8_pack": ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p], None),
            "int8_linear": ([ctypes.POINTER(_NativeCall), ctypes.c_int], ctypes.c_int),
        },
    )


def native_rows(function, template: ctypes.Structure, flat: torch.Tensor, out_features: int) -> torch.Tensor:
    """One call of a native Linear kernel (int8_gemm.c, int4_gemm.c) on fp32 rows `flat`: a copy of
    the layer's call structure `template` (callers on other threads may overlap) given the rows and a
    new output, run on this thread's torch threads."""
    y = torch.empty(flat.shape[0], out_features)
    call = type(template).from_buffer_copy(template)
    call.x, call.x_row, call.m, call.y = flat.data_ptr(), flat.stride(0), flat.shape[0], y.data_ptr()
    if function(ctypes.byref(call), torch.get_num_threads()):
        raise MemoryError("a native Linear kernel could not allocate its scratch memory")
    return y


def available_kernels() -> list[str]:
    """The kernels this machine can run: FBGEMM always (x86), oneDNN where torch has it, the native
    one where a C compiler builds it."""
    kernels = ["fbgemm"]
    if torch.backends.mkldnn.is_available():
        kernels.append("onednn")
    try:
        native_library()
        kernels.append("native")
    except native.BUILD_ERRORS as exc:
        log.warning("the native INT8 kernel is unavailable: %s", exc)
    return kernels


NATIVE_GROUP = 32  # int8_gemm.c's GROUP: output channels per packed group, the same layout on every CPU


def _padded(n: int, k: int) -> tuple[int, int]:
    return -(-n // NATIVE_GROUP) * NATIVE_GROUP, -(-k // 4) * 4


def pack_native(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows (n × k) in int8_gemm.c's layout — [n/32][k/4][32][4], zero padded, flat — and each
    row's sum. Computed with torch (the layout does not depend on the CPU): any machine writes it,
    with or without a C compiler; tests/test_int8_linear.py checks it against `int8_pack`."""
    n, k = rows.shape
    n_pad, k_pad = _padded(n, k)
    padded = rows.contiguous()
    if (n_pad, k_pad) != (n, k):
        padded = torch.zeros(n_pad, k_pad, dtype=torch.int8)
        padded[:n, :k] = rows
    packed = padded.view(n_pad // NATIVE_GROUP, NATIVE_GROUP, k_pad // 4, 4).permute(0, 2, 1, 3).reshape(-1)
    # In chunks: sum(dtype=int32) widens its whole input first (4× the int8 rows: 85 MB for 4608²).
    step = rows_per_chunk(rows.shape)
    return packed, torch.cat([rows[i : i + step].sum(1, dtype=torch.int32) for i in range(0, n, step)])


def native_view(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The packed weights seen as [n/32][k/4][32][4] (a view: no copy)."""
    n_pad, k_pad = _padded(n, k)
    return packed.view(n_pad // NATIVE_GROUP, k_pad // 4, NATIVE_GROUP, 4)


def unpack_native(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int8 rows (n × k) of weights in int8_gemm.c's layout (a copy)."""
    n_pad, k_pad = _padded(n, k)
    return native_view(packed, n, k).permute(0, 2, 1, 3).reshape(n_pad, k_pad)[:n, :k].contiguous()


class Int8Linear(nn.Module):
    """A Linear on packed int8 weights (FBGEMM, oneDNN or the native kernel), activations quantized
    per row (see the module docstring). `rows`: int8 [out, in]; `scales`: fp32 [out]. Weights already
    in the native layout (`native_layout`: packed and column sums, e.g. views of a mapped checkpoint)
    are used in place by the native kernel; rows may then be None, `in_features` saying the width."""

    def __init__(
        self,
        rows: torch.Tensor | None,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        activations: str = "per_token",
        kernel: str = "fbgemm",
        native_layout: tuple[torch.Tensor, torch.Tensor] | None = None,
        in_features: int | None = None,
    ):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}")
        if kernel == "native" and activations != "per_token":
            raise ValueError("the native kernel quantizes activations per token only")
        self.out_features = scales.shape[0]
        self.in_features = rows.shape[1] if rows is not None else in_features
        self.activations, self.kernel = activations, kernel
        self._scales = scales.float().contiguous()
        if rows is None and kernel != "native":
            rows = unpack_native(native_layout[0], self.out_features, self.in_features)
        # Packed without the bias: per-token outputs are scaled back first, then the bias is added.
        if kernel == "native":
            lib = native_library()
            if native_layout is not None:
                self._packed, self._column_sums = native_layout
            else:
                rows = rows.contiguous()
                self._packed = torch.empty(lib.int8_packed_bytes(*rows.shape), dtype=torch.int8)
                native.huge_pages(self._packed.data_ptr(), self._packed.numel())  # before the packing writes it
                self._column_sums = torch.empty(rows.shape[0], dtype=torch.int32)
                lib.int8_pack(rows.data_ptr(), *rows.shape, self._packed.data_ptr(), self._column_sums.data_ptr())
            if self._packed.numel() != lib.int8_packed_bytes(self.out_features, self.in_features):
                raise ValueError(f"packed int8 weights of {self._packed.numel()} bytes for a Linear of this shape")
            self._call = _NativeCall(
                n=self.out_features,
                k=self.in_features,
                packed=self._packed.data_ptr(),
                column_sums=self._column_sums.data_ptr(),
                scales=self._scales.data_ptr(),
                y_row=self.out_features,
            )
            self._native = lib
        elif kernel == "fbgemm":
            qweight = torch._make_per_channel_quantized_tensor(
                rows, self._scales.double(), torch.zeros(rows.shape[0], dtype=torch.long), 0
            )
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        else:
            self._packed = torch.ops.onednn.qlinear_prepack(rows, None)
            self._zero_points = torch.zeros(rows.shape[0], dtype=torch.long)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        if kernel == "native":
            self._call.bias = None if self.bias is None else self.bias.data_ptr()

    @classmethod
    def from_float(cls, linear: nn.Linear, activations: str = "per_token", kernel: str = "fbgemm") -> Int8Linear:
        return cls(*quantize_rows(linear.weight.detach()), linear.bias, activations, kernel)

    def _onednn(self, q: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
        return torch.ops.onednn.qlinear_pointwise(
            q,
            scale,
            zero_point,
            self._packed,
            self._scales,
            self._zero_points,
            None,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        if self.kernel == "native":  # quantization, GEMM and scaling back in one call; the bias too
            return self._forward_native(flat).view(*x.shape[:-1], self.out_features)
        if self.activations == "per_tensor":
            y = self._per_tensor(flat)
        else:
            # max(|x|) per row, the same value either way: for a few rows |x| then amax (fewer calls),
            # for many amax and amin (no |x| temporary; vector_norm(inf) is 5x slower than both)
            if flat.shape[0] <= 16:
                peak = flat.abs().amax(-1, keepdim=True).clamp_min_(_TINY)
            else:
                peak = torch.maximum(flat.amax(-1, keepdim=True), flat.amin(-1, keepdim=True).neg_()).clamp_min_(_TINY)
            if self.kernel == "fbgemm":
                y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                    flat / peak, ACTIVATION_SCALE, ACTIVATION_ZERO_POINT, self._packed
                )
            else:  # the uint8 values FBGEMM makes of flat / peak: round(x / peak · 64 + 64), the sum rounded
                # before the rounding to an integer (its fma), and x / (peak · 2^-6) = (x / peak) · 64 exactly
                q = torch.div(flat, peak * ACTIVATION_SCALE).add_(ACTIVATION_ZERO_POINT).round_().to(torch.uint8)
                y = self._onednn(q, ACTIVATION_SCALE, ACTIVATION_ZERO_POINT)
            y.mul_(peak)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def _forward_native(self, flat: torch.Tensor) -> torch.Tensor:
        return native_rows(self._native.int8_linear, self._call, flat, self.out_features)

    def _per_tensor(self, flat: torch.Tensor) -> torch.Tensor:
        """torch's dynamic quantization: one scale for the whole input (7-bit range, as FBGEMM's)."""
        if self.kernel == "fbgemm":
            return torch.ops.quantized.linear_dynamic(flat, self._packed, True)
        scale, zero_point = torch._choose_qparams_per_tensor(flat, True)
        q = torch.quantize_per_tensor(flat, scale, zero_point, torch.quint8).int_repr()
        return self._onednn(q, scale, zero_point)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int8 ({self.kernel}), "
            f"{self.activations} activations"
        )


class MappedInt8Linear(nn.Module):
    """Int8 Linear computing from memory-mapped weights (weight-only int8, bf16 or fp32 activations).

    Used when the packed model would not fit MAX_MEMORY_MB: nothing is copied, so the kernel can
    drop the weight pages under pressure and read them back from disk; slower than the packed kernel.
    A fused projection is several mapped parts whose outputs are concatenated.

    `activations="bf16"` (the default): a few rows (decode) go to `torch._weight_int8pack_mm` in
    bf16, its vectorized path (fp32 input takes scalar code), many rows (prefill, pictures) to bf16
    GEMMs on dequantized slices where the CPU has AVX512-BF16 (fp32 slices elsewhere); the fp32
    per-channel scales are applied to the outputs. Activations rounded to bf16 (8 bits of mantissa)
    is this mode's accuracy cost (bench_deploy measures its greedy agreement with the packed mode).
    "fp32" is the former way (fp32 GEMV for a few rows, fp32 slices of the weight for more).
    """

    def __init__(
        self, parts: list[tuple[torch.Tensor, torch.Tensor]], bias: torch.Tensor | None, activations: str = "bf16"
    ):
        super().__init__()
        if activations not in ("bf16", "fp32"):
            raise ValueError("activations must be bf16 or fp32")
        self.activations = activations
        self.in_features = parts[0][0].shape[1]
        self.out_features = sum(rows.shape[0] for rows, _ in parts)
        for i, (rows, scales) in enumerate(parts):
            self.register_buffer(f"rows{i}", rows)
            self.register_buffer(f"scales{i}", scales.float())
        self.parts = len(parts)
        self._ones = torch.ones(max(rows.shape[0] for rows, _ in parts), dtype=torch.bfloat16)
        self.register_buffer("bias", None if bias is None else bias.float())

    def _part(self, flat: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if self.activations == "bf16" and flat.shape[0] <= MAPPED_GEMV_ROWS:
            if flat.shape[0] >= 4 and rows.data_ptr() % 16:  # its bf16 kernel crashes there on unaligned weights
                return torch.cat([self._part(flat[i : i + 3], rows, scales) for i in range(0, flat.shape[0], 3)])
            return torch._weight_int8pack_mm(flat, rows, self._ones[: rows.shape[0]]).float().mul_(scales)
        if self.activations == "fp32" and flat.shape[0] <= GEMV_ROWS:
            return torch._weight_int8pack_mm(flat, rows, scales)
        # Many rows (prefill, pictures): a slice of the weight dequantized at a time, in bf16 where the CPU
        # computes bf16 GEMMs natively (AVX512-BF16 / AMX), else in fp32; the scales applied to the output.
        dtype = torch.bfloat16 if _BF16_GEMM and self.activations == "bf16" else torch.float32
        x = flat.to(dtype)
        return torch.cat(
            [
                nn.functional.linear(x, rows[i : i + MAPPED_SLICE].to(dtype)).float().mul_(scales[i : i + MAPPED_SLICE])
                for i in range(0, rows.shape[0], MAPPED_SLICE)
            ],
            dim=1,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.bfloat16 if self.activations == "bf16" else torch.float32
        flat = x.reshape(-1, self.in_features).to(dtype).contiguous()
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


class PackedInt8Embedding(nn.Module):
    """`Int8Embedding` read from a tied lm_head's weights in the native layout (a mapped checkpoint's):
    each looked-up row gathered from its packed group — the same values, no row-major copy."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, embedding_dim: int, padding_idx: int | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = scales.shape[0], embedding_dim
        self.padding_idx = padding_idx
        self.register_buffer("scales", scales)
        self._packed = packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        groups = native_view(self._packed, self.num_embeddings, self.embedding_dim)
        rows = groups[flat // NATIVE_GROUP, :, flat % NATIVE_GROUP].reshape(len(flat), -1)[:, : self.embedding_dim]
        return (rows.float() * self.scales[flat].unsqueeze(-1)).view(*ids.shape, -1)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 rows of the packed lm_head"


def set_activations(model: nn.Module, activations: str) -> None:
    """Switch every Int8Linear of `model` to `activations` (the same packed weights): for the
    benchmarks and tests that compare per-token with per-tensor quantization in one process."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}")
    for module in model.modules():
        if isinstance(module, Int8Linear):
            if module.kernel == "native" and activations != "per_token":
                raise ValueError("the native kernel quantizes per token only: load with INT8_KERNEL=fbgemm or onednn")
            module.activations = activations
