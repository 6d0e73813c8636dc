"""4-bit layers: group-wise weights, activations quantized per row, the service's own kernel.

A weight is s·(w − z): w an unsigned 4-bit value, and per group of `group` inputs along a row a zero
point z (0..15) and an fp16 scale s — the form GPTQ and AWQ checkpoints store, so theirs convert
exactly (service/quant/published.py), and symmetric quantization is z = 8. Activations are quantized per
row exactly as the INT8 layers quantize them (int8_linear.py), so a row's result never depends on the
other rows of a call: the same bits alone, in a prefill piece of any length or in a decode batch.
`service/native/int4_gemm.c` computes it: integer sums per group, the groups added in float in one
fixed order. Its packed layout does not depend on the CPU, so a 4-bit checkpoint stores it as is
and loading is a read (or a memory map when the budget is short).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from .. import native
from .int8_linear import native_rows

GROUP_SIZES = (32, 64, 128, 256)
SYMMETRIC_ZERO = 8
CLIP_RATIOS = (
    1.0,
    0.95,
    0.9,
    0.85,
    0.8,
    0.75,
)  # range shrinks tried per group: the one with the least squared error wins
QUANTIZE_ROWS = 2048  # rows quantized at once (the candidates of a chunk: ~100 MB for 2048-wide rows)
_FP16_TINY = 2.0**-14  # smallest normal fp16: scales below it would lose precision


# int4_gemm.c's `Int4Linear`: one call's input, weights and output
_NativeCall = native.linear_call("_NativeCall", ("group",), ("packed", "zeros", "scales"))


@functools.cache
def native_library() -> ctypes.CDLL:
    """int4_gemm.c built for this CPU, its functions typed (once per process)."""
    return native.typed_library(
        native.INT4_GEMM,
        {
            "int4_packed_bytes": ([ctypes.c_int, ctypes.c_int], ctypes.c_int64),
            "int4_group_entries": ([ctypes.c_int, ctypes.c_int, ctypes.c_int], ctypes.c_int64),
            "int4_pack": ([ctypes.c_void_p] * 3 + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 3, None),
            "int4_linear": ([ctypes.POINTER(_NativeCall), ctypes.c_int], ctypes.c_int),
            "int4_experts": ([ctypes.POINTER(_NativeExperts), ctypes.c_int, ctypes.c_int], ctypes.c_int),
        },
    )


def supports(shape: tuple[int, int], group: int) -> bool:
    """Whether a Linear of weight `shape` (out, in) can be 4-bit in groups of `group` inputs."""
    return shape[1] % group == 0 and group % 8 == 0


def group_for(in_features: int, group: int) -> int | None:
    """The group size a Linear of `in_features` inputs gets when `group` is asked for: `group`, or
    the largest smaller one of GROUP_SIZES that divides the inputs; None if none does (it stays INT8)."""
    return next((g for g in sorted(GROUP_SIZES, reverse=True) if g <= group and in_features % g == 0), None)


def quantize_groups(
    weight: torch.Tensor, group: int, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values u8 [out, in] in 0..15, zero points u8 [out, in/group], fp16 scales [out, in/group]).

    Each group's range (min..max, or ±max symmetric) is shrunk by each of CLIP_RATIOS and the one
    whose rounded weights are closest (least squared error) is kept — clipping a rare large weight
    buys the others precision. Scales are rounded to fp16 before the values are computed from them.
    """
    out, k = weight.shape
    if not supports(weight.shape, group):
        raise ValueError(f"{k} inputs do not split into groups of {group}")
    values, zeros, scales = [], [], []
    for start in range(0, out, QUANTIZE_ROWS):
        w = weight[start : start + QUANTIZE_ROWS].float().reshape(-1, k // group, group)
        if symmetric:  # the ranges, once (each ratio below scales them: the same values as recomputing)
            largest = w.abs().amax(-1, keepdim=True)
        else:
            smallest, largest = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        best = None
        for ratio in CLIP_RATIOS:
            if symmetric:
                peak = largest * ratio
                scale = (peak / SYMMETRIC_ZERO).clamp_min(_FP16_TINY).half().float()
                zero = torch.full_like(scale, SYMMETRIC_ZERO)
            else:
                low, high = smallest * ratio, largest * ratio
                low, high = low.clamp(max=0), high.clamp(min=0)  # zero stays representable (exact zeros stay zero)
                scale = ((high - low) / 15).clamp_min(_FP16_TINY).half().float()
                zero = (-low / scale).round().clamp(0, 15)
            q = (w / scale).round().add_(zero).clamp_(0, 15)
            error = (q - zero).mul_(scale).sub_(w).square_().sum(-1, keepdim=True)
            if best is None:
                best = [q, zero, scale, error]
            else:
                better = error < best[3]
                for i, candidate in enumerate((q, zero, scale, error)):
                    best[i] = torch.where(better, candidate, best[i])
        q, zero, scale, _ = best
        values.append(q.reshape(-1, k).to(torch.uint8))
        zeros.append(zero.squeeze(-1).to(torch.uint8))
        scales.append(scale.squeeze(-1).half())
    return torch.cat(values), torch.cat(zeros), torch.cat(scales)


def dequantize(values: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight s·(w − z) of `quantize_groups`'s output (tests, the fidelity benchmark, a published
    4-bit router: exact, a 5-bit integer times an fp16 scale fits fp32)."""
    out, k = values.shape
    group = k // zeros.shape[1]
    w = values.float().reshape(out, -1, group) - zeros.float().unsqueeze(-1)
    return (w * scales.float().unsqueeze(-1)).reshape(out, k)


def pack(values: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """The kernel's layout of one weight: {"qweight", "qzeros", "scales"} (CPU-independent bytes)."""
    lib = native_library()
    n, k = values.shape
    group = k // zeros.shape[1]
    packed = torch.empty(lib.int4_packed_bytes(n, k), dtype=torch.uint8)
    packed_zeros = torch.empty(lib.int4_group_entries(n, k, group), dtype=torch.uint8)
    packed_scales = torch.empty(lib.int4_group_entries(n, k, group), dtype=torch.float16)
    values, zeros, scales = values.contiguous(), zeros.contiguous(), scales.half().contiguous()
    lib.int4_pack(
        values.data_ptr(),
        zeros.data_ptr(),
        scales.data_ptr(),
        n,
        k,
        group,
        packed.data_ptr(),
        packed_zeros.data_ptr(),
        packed_scales.data_ptr(),
    )
    return {"qweight": packed, "qzeros": packed_zeros, "scales": packed_scales}


class Int4Linear(nn.Module):
    """A Linear on packed 4-bit weights (see the module docstring); `packed` is `pack`'s output,
    owned memory or views of a mapped file (the kernel reads either)."""

    def __init__(
        self,
        packed: dict[str, torch.Tensor],
        out_features: int,
        in_features: int,
        group: int,
        bias: torch.Tensor | None,
    ):
        super().__init__()
        lib = native_library()
        self.out_features, self.in_features, self.group = out_features, in_features, group
        if not supports((out_features, in_features), group):
            raise ValueError(f"{in_features} inputs do not split into groups of {group}")
        sizes = {
            "qweight": lib.int4_packed_bytes(out_features, in_features),
            "qzeros": lib.int4_group_entries(out_features, in_features, group),
            "scales": lib.int4_group_entries(out_features, in_features, group),
        }
        for name, size in sizes.items():
            if packed[name].numel() != size:
                raise ValueError(f"4-bit {name} of {packed[name].numel()} entries; {size} expected")
        # Not buffers: `model.float()` must not convert the fp16 scales, and state dicts do not need them.
        self.qweight, self.qzeros, self.scales = packed["qweight"], packed["qzeros"], packed["scales"]
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self._call = _NativeCall(
            k=in_features,
            n=out_features,
            group=self.group,
            packed=self.qweight.data_ptr(),
            zeros=self.qzeros.data_ptr(),
            scales=self.scales.data_ptr(),
            bias=None if self.bias is None else self.bias.data_ptr(),
            y_row=out_features,
        )
        self._native = lib

    @classmethod
    def from_float(cls, linear: nn.Linear, group: int = 128, symmetric: bool = False) -> Int4Linear:
        packed = pack(*quantize_groups(linear.weight.detach(), group, symmetric))
        return cls(packed, linear.out_features, linear.in_features, group, linear.bias)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.qzeros, self.scales))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        y = native_rows(self._native.int4_linear, self._call, flat, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 4-bit (group {self.group})"


class _NativeExperts(ctypes.Structure):
    """int4_gemm.c's `Int4Experts`: one call's rows, their experts and every expert's weights."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("m", ctypes.c_int),
        ("hidden", ctypes.c_int),
        ("width", ctypes.c_int),
        ("top_k", ctypes.c_int),
        ("up_group", ctypes.c_int),
        ("down_group", ctypes.c_int),
        ("chosen", ctypes.c_void_p),
        ("weights", ctypes.c_void_p),
        *((name, ctypes.c_void_p) for name in ("up_packed", "up_zeros", "up_scales")),
        *((name, ctypes.c_void_p) for name in ("down_packed", "down_zeros", "down_scales")),
        ("y", ctypes.c_void_p),
    ]


class Int4Experts:
    """A mixture-of-experts layer's 4-bit experts (each a gate/up and a down `Int4Linear`) run by one
    native call per layer: `experts(h, weights, chosen)` is Σ over each row's ranks, in rank order, of
    weight · down(silu(gate) · up) — int4_gemm.c's `int4_experts` (every expert's rows in one parallel
    loop; each row's result its own). None of `gate_up`/`down` may be anything but Int4Linear."""

    def __init__(self, gate_up: list[Int4Linear], down: list[Int4Linear]):
        self.hidden, self.width = gate_up[0].in_features, down[0].in_features
        self.experts = len(gate_up)
        for up, dn in zip(gate_up, down, strict=True):
            if (up.in_features, up.out_features, dn.out_features) != (self.hidden, 2 * self.width, self.hidden):
                raise ValueError("experts of different shapes")
            if up.bias is not None or dn.bias is not None or (up.group, dn.group) != (gate_up[0].group, down[0].group):
                raise ValueError("experts with a bias or their own group sizes")
        self._linears = (gate_up, down)  # keeps the weights the pointers below point into alive
        pointers = ctypes.c_void_p * self.experts
        self._arrays = {  # the per-expert pointer arrays the call structure points to
            f"{side}_{part}": pointers(*(getattr(lin, name).data_ptr() for lin in linears))
            for side, linears in (("up", gate_up), ("down", down))
            for part, name in (("packed", "qweight"), ("zeros", "qzeros"), ("scales", "scales"))
        }
        self._call = _NativeExperts(
            hidden=self.hidden,
            width=self.width,
            up_group=gate_up[0].group,
            down_group=down[0].group,
            **{name: ctypes.addressof(array) for name, array in self._arrays.items()},
        )
        self._native = native_library()

    def __call__(self, h: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        h = h.float().contiguous()
        weights, chosen = weights.float().contiguous(), chosen.to(torch.int64).contiguous()
        y = torch.empty(h.shape[0], self.hidden)
        call = _NativeExperts.from_buffer_copy(self._call)
        call.x, call.m, call.top_k, call.chosen = h.data_ptr(), h.shape[0], chosen.shape[1], chosen.data_ptr()
        call.weights, call.y = weights.data_ptr(), y.data_ptr()
        status = self._native.int4_experts(ctypes.byref(call), self.experts, torch.get_num_threads())
        if status == 3:
            raise ValueError("an expert number out of range")
        if status:
            raise MemoryError("the 4-bit experts kernel could not allocate its scratch memory")
        return y
