"""The float operations of an answer's path, the same bits on every CPU (service/native/float_ops.c).

torch's norms, activations, softmax, sin/cos and float matrix products take instruction-set-specific
paths (ATen's AVX2 or AVX-512 kernels, MKL's and oneDNN's dispatch): their sums run in other orders
and their exp, tanh and erf round otherwise, so a model's logits differ in the last bits between an
AVX2 machine and an AVX-512 one, and one flipped rounding before an activation is quantized grows into
another answer. These functions compute the same math in one fixed order with one implementation of
each transcendental (fixed.h), whatever the CPU — and each row alone, so a row's result never depends
on the other rows of a call either (`Linear` included: each output one chain of fused multiply-adds
over its inputs in order).

Each takes float32 tensors whose last dimension is contiguous and returns a new tensor. Without a C
compiler (or for other dtypes: the bf16 activations of memory-mapped weights) they fall back to the
torch op they replace, logged once: the same results within float rounding, torch's bits on each CPU.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from . import BUILD_ERRORS, FLOAT_OPS, typed_library

log = logging.getLogger(__name__)


class _Rows(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("x_row", ctypes.c_int64),
        ("x_group", ctypes.c_int64),
        ("rows", ctypes.c_int),
        ("groups", ctypes.c_int),
        ("n", ctypes.c_int),
        ("weight", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("z", ctypes.c_void_p),
        ("z_row", ctypes.c_int64),
        ("z_group", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("y", ctypes.c_void_p),
        ("y_row", ctypes.c_int64),
        ("y_group", ctypes.c_int64),
    ]


class _Gemm(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("x_row", ctypes.c_int64),
        ("m", ctypes.c_int),
        ("k", ctypes.c_int),
        ("n", ctypes.c_int),
        ("packed", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("y_row", ctypes.c_int64),
    ]


class _VisionAttention(ctypes.Structure):
    _fields_ = [
        ("qkv", ctypes.c_void_p),
        ("qkv_row", ctypes.c_int64),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("starts", ctypes.c_void_p),
        ("segments", ctypes.c_int),
        ("heads", ctypes.c_int),
        ("dim", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("out", ctypes.c_void_p),
        ("out_row", ctypes.c_int64),
    ]


_ROWS = ctypes.POINTER(_Rows)
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "rms_norm": ([_ROWS, ctypes.c_int], None),
    "layer_norm": ([_ROWS, ctypes.c_int], None),
    "softmax": ([_ROWS, ctypes.c_int], None),
    "log_softmax": ([_ROWS, ctypes.c_int], None),
    "unary": ([ctypes.c_int, _ROWS, ctypes.c_int], None),
    "silu_mul": ([_ROWS, ctypes.c_int], None),
    "rms_norm_rows": ([_P, _I64, _INT, _INT, _P, ctypes.c_float, _P, _INT], None),
    "silu_mul_rows": ([_P, _I64, _P, _I64, _INT, _INT, _P, _INT], None),
    "log_softmax_at": ([_P, _INT, _INT], ctypes.c_float),
    "cos_sin": ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p], None),
    "float_packed_floats": ([ctypes.c_int, ctypes.c_int], ctypes.c_int64),
    "float_pack": ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p], None),
    "float_gemm": ([ctypes.POINTER(_Gemm), ctypes.c_int], ctypes.c_int),
    "vision_attention": ([ctypes.POINTER(_VisionAttention), ctypes.c_int], ctypes.c_int),
}
SILU, SIGMOID, GELU_TANH, GELU_ERF = range(4)

_march: str | None = None  # None: the build for this process's CPU (or NATIVE_MARCH)


@functools.cache
def _library(march: str | None):
    try:
        return typed_library(FLOAT_OPS, _SIGNATURES, march)
    except BUILD_ERRORS as exc:
        log.warning("the fixed-order float kernels are unavailable (%s): torch's ops, whose bits differ by CPU", exc)
        return None


def library():
    """float_ops.c built for this CPU (or NATIVE_MARCH), or None without a compiler."""
    return _library(_march)


def available() -> bool:
    """Whether the float operations run the fixed-order kernels (else torch's ops)."""
    return library() is not None


def _threads() -> int:
    return torch.get_num_threads()


def _layout(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """x as vectors of its last dimension: (x or a contiguous copy, rows, groups, row stride, group stride)."""
    if x.dim() == 2 and x.stride(1) == 1:  # the forward's usual rows, at a few microseconds a call
        return x, x.shape[0], 1, x.stride(0), 0
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        x = x.contiguous()
    dims = [(size, stride) for size, stride in zip(x.shape[:-1], x.stride()[:-1]) if size != 1]
    merged: list[tuple[int, int]] = []
    for size, stride in dims:  # a dimension that steps over the next one whole is one with it
        if merged and merged[-1][1] == stride * size:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    if len(merged) > 2:
        return _layout(x.contiguous())
    merged = [(1, 0)] * (2 - len(merged)) + merged
    (rows, row_stride), (groups, group_stride) = merged
    return x, rows, groups, row_stride, group_stride


def _rows(x: torch.Tensor, y: torch.Tensor, **fields) -> tuple[_Rows, torch.Tensor]:
    """The call's vectors (and the tensor they point into, which must outlive the call): x's, with y
    a new contiguous tensor of x's shape."""
    x, rows, groups, x_row, x_group = _layout(x if x.dim() else x.reshape(1))
    n = x.shape[-1]
    call = _Rows(x.data_ptr(), x_row, x_group, rows, groups, n, **fields)
    call.y, call.y_row, call.y_group = y.data_ptr(), groups * n, n
    return call, x


def _usable(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and not t.is_cuda for t in tensors) and library() is not None


def _out(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.float32)


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _vector(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or (t.dtype == torch.float32 and t.is_contiguous()):
        return t
    return t.detach().float().contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · weight over the last dimension (F.rms_norm)."""
    if not _usable(x) or x.numel() == 0:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    weight = _vector(weight)
    if x.dim() == 2 and x.stride(1) == 1:  # the decoder's rows: plain arguments, a few microseconds less
        rows, n = x.shape
        y = torch.empty(rows, n)
        library().rms_norm_rows(x.data_ptr(), x.stride(0), rows, n, _pointer(weight), eps, y.data_ptr(), _threads())
        return y
    y = _out(x)
    call, _ = _rows(x, y, weight=_pointer(weight), eps=eps)
    library().rms_norm(ctypes.byref(call), _threads())
    return y


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) · weight + bias over the last dimension (F.layer_norm)."""
    if not _usable(x) or x.numel() == 0:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    weight, bias = _vector(weight), _vector(bias)
    y = _out(x)
    call, _ = _rows(x, y, weight=_pointer(weight), bias=_pointer(bias), eps=eps)
    library().layer_norm(ctypes.byref(call), _threads())
    return y


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension."""
    if not _usable(x) or x.numel() == 0:
        return x.softmax(-1)
    y = _out(x)
    call, _ = _rows(x, y)
    library().softmax(ctypes.byref(call), _threads())
    return y


def log_softmax_at(row: torch.Tensor, index: int) -> float:
    """log_softmax(row)[index] (a vector of float32), with its bits, without the rest of it."""
    if not _usable(row) or row.dim() != 1:
        return float(log_softmax(row)[index])
    row = row.contiguous()
    return library().log_softmax_at(row.data_ptr(), row.numel(), index)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dimension."""
    if not _usable(x) or x.numel() == 0:
        return x.log_softmax(-1)
    y = _out(x)
    call, _ = _rows(x, y)
    library().log_softmax(ctypes.byref(call), _threads())
    return y


_TORCH_UNARY = {
    SILU: F.silu,
    SIGMOID: torch.sigmoid,
    GELU_TANH: functools.partial(F.gelu, approximate="tanh"),
    GELU_ERF: F.gelu,
}


def _unary(kind: int, x: torch.Tensor) -> torch.Tensor:
    if not _usable(x) or x.numel() == 0:
        return _TORCH_UNARY[kind](x)
    y = _out(x)
    call, _ = _rows(x, y)
    library().unary(kind, ctypes.byref(call), _threads())
    return y


def silu(x: torch.Tensor) -> torch.Tensor:
    """x · sigmoid(x), computed as x / (1 + e^-x) (F.silu)."""
    return _unary(SILU, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _unary(SIGMOID, x)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """F.gelu: with erf ("none") or its tanh approximation ("tanh")."""
    return _unary(GELU_TANH if approximate == "tanh" else GELU_ERF, x)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up — the bits of `silu(gate) * up`, in one pass."""
    if not _usable(gate, up) or gate.numel() == 0 or gate.shape != up.shape:
        return silu(gate) * up
    if gate.dim() == 2 and gate.stride(1) == 1 and up.stride(1) == 1:  # the MLP's halves of one gate_up row
        rows, n = gate.shape
        y = torch.empty(rows, n)
        library().silu_mul_rows(
            gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), rows, n, y.data_ptr(), _threads()
        )
        return y
    up, up_rows, up_groups, up_row, up_group = _layout(up)
    if _layout(gate)[1:3] != (up_rows, up_groups):
        return silu(gate) * up
    y = _out(gate)
    call, _ = _rows(gate, y, z=up.data_ptr(), z_row=up_row, z_group=up_group)
    library().silu_mul(ctypes.byref(call), _threads())
    return y


def cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of float32 angles, each computed in double and rounded (torch's per-CPU sin/cos round
    otherwise)."""
    angles = angles.float().contiguous()
    if library() is None:
        return angles.cos(), angles.sin()
    cos, sin = torch.empty_like(angles), torch.empty_like(angles)
    library().cos_sin(angles.data_ptr(), angles.numel(), cos.data_ptr(), sin.data_ptr())
    return cos, sin


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A Linear's weight (out × in) in `gemm`'s layout: panels of 16 output columns."""
    n, k = weight.shape
    weight = weight.detach().float().contiguous()
    packed = torch.empty(library().float_packed_floats(n, k))
    library().float_pack(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`pack`'s inverse: the out × in weight."""
    panels = (n + 15) // 16
    return packed.view(panels, k, 16).permute(0, 2, 1).reshape(panels * 16, k)[:n].contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows × k, float32) · wᵀ + bias, w packed by `pack`: each output one chain of fused
    multiply-adds over its inputs in order, so a row's result depends on that row alone."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, n)
    if m == 0:
        return y
    if k == 0:
        return y.copy_(bias.expand(m, n)) if bias is not None else y.zero_()
    call = _Gemm(x.data_ptr(), x.stride(0), m, k, n, packed.data_ptr(), _pointer(bias), y.data_ptr(), n)
    if library().float_gemm(ctypes.byref(call), _threads()):
        raise MemoryError("the float GEMM could not allocate its scratch memory")
    return y


class Linear(nn.Module):
    """An nn.Linear computed by `gemm` (its weight packed once): the same bits for a row alone or in
    any call, on every CPU. `weight` unpacks the matrix for the rare reader (the forward never does)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", pack(weight))
        self.register_buffer("bias", _vector(bias))

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Linear:
        return cls(linear.weight, linear.bias)

    @property
    def weight(self) -> torch.Tensor:
        return unpack(self.packed, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        return gemm(flat, self.packed, self.out_features, self.bias).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fixed-order fp32"


class PackedEmbedding(nn.Module):
    """A tied embedding read from its lm_head's packed weight (a `Linear`'s: token i's row is its output
    column i), so the table is held once, as nn.Embedding and its nn.Linear shared one tensor."""

    def __init__(self, lm_head: Linear, padding_idx: int | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = lm_head.out_features, lm_head.in_features
        self.padding_idx = padding_idx
        self.register_buffer("packed", lm_head.packed, persistent=False)  # the same tensor

    @property
    def weight(self) -> torch.Tensor:
        return unpack(self.packed, self.num_embeddings, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        panels = self.packed.view(-1, self.embedding_dim, 16)
        return panels[ids // 16, :, ids % 16]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the packed lm_head"


def fixed_order_linears(model: nn.Module) -> int:
    """Every nn.Linear of `model` as a `Linear` (fp32 weights: MKL's GEMMs round by the CPU and by the
    number of rows), a tied embedding read from its lm_head's packed weight; how many. Without a
    compiler the model keeps torch's."""
    if library() is None:
        return 0
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = getattr(model, "lm_head", None)
    tied = embedding is not None and type(head) is nn.Linear and head.weight is getattr(embedding, "weight", None)
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, Linear.from_linear(getattr(owner, attr)))
    if tied:
        name = next(n for n, m in model.named_modules() if m is embedding)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, PackedEmbedding(model.lm_head, embedding.padding_idx))
    return len(names)


class Activation(nn.Module):
    """An activation module (the checkpoint's `act_fn`) computed by this module's kernels."""

    def __init__(self, kind: int):
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _unary(self.kind, x)

    def extra_repr(self) -> str:
        return ["silu", "sigmoid", "gelu_tanh", "gelu"][self.kind] + ", fixed order"


def vision_attention(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, starts: list[int], heads: int, scale: float
) -> torch.Tensor | None:
    """The vision tower's attention over the qkv Linear's output (tokens × 3·heads·dim: query heads,
    key heads, value heads), with the rotary embedding (cos, sin: tokens × dim) applied first; each
    segment [starts[i], starts[i+1]) attends within itself. tokens × heads·dim, or None without the
    kernel (the caller computes torch's)."""
    if not _usable(qkv, cos, sin) or qkv.stride(-1) != 1:
        return None
    tokens = qkv.shape[0]
    dim = qkv.shape[1] // (3 * heads)
    cos, sin = cos.contiguous(), sin.contiguous()
    offsets = (ctypes.c_int32 * len(starts))(*starts)
    out = torch.empty(tokens, heads * dim)
    call = _VisionAttention(
        qkv.data_ptr(),
        qkv.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        ctypes.addressof(offsets),
        len(starts) - 1,
        heads,
        dim,
        scale,
        out.data_ptr(),
        out.stride(0),
    )
    status = library().vision_attention(ctypes.byref(call), _threads())
    if status:
        raise MemoryError("the vision attention kernel could not allocate its scratch memory")
    return out
