"""Causal attention with the same bits for a token whichever path computes it (see attention.c).

`ExactAttention.load()` compiles attention.c once per machine (service/native/__init__.py) and loads it;
the result is a callable

    attention(q, keys, values, start, out)

for one sequence: `q` holds n query rows (n × q_heads × dim, float32, rows may be strided) at
positions start … start+n-1, `keys`/`values` the sequence's cached layer (1 × kv_heads × length ×
dim, float32 or bfloat16, its first start+n positions written), `out` receives n × q_heads × dim.

Without a C compiler the same interface runs `TorchAttention`: one SDPA call per query row, the call
a decode step makes, so it is exact too — but prefill pays a call per token (a warning says so).
"""

from __future__ import annotations

import ctypes
import logging

import torch
import torch.nn.functional as F

from .. import native

log = logging.getLogger(__name__)


class _Call(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_row", ctypes.c_int64),
        ("n", ctypes.c_int),
        ("start", ctypes.c_int),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("kv_head", ctypes.c_int64),
        ("kv_token", ctypes.c_int64),
        ("bf16", ctypes.c_int),
        ("out", ctypes.c_void_p),
        ("out_row", ctypes.c_int64),
        ("q_heads", ctypes.c_int),
        ("kv_heads", ctypes.c_int),
        ("dim", ctypes.c_int),
        ("scale", ctypes.c_float),
    ]


class ExactAttention:
    """The compiled kernel (attention.c); see the module docstring."""

    name = "c"

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        self._lib.attention.argtypes = [ctypes.POINTER(_Call), ctypes.c_int]
        self._lib.attention.restype = ctypes.c_int
        self.lanes = self._lib.attention_lanes()

    @classmethod
    def load(cls, march: str | None = None) -> ExactAttention | TorchAttention:
        """The C kernel (built for this CPU, NATIVE_MARCH or `march`), or the per-row torch fallback
        (logged) where it cannot be built."""
        try:
            return cls(native.library(native.ATTENTION, march))
        except native.BUILD_ERRORS as exc:
            log.warning("exact attention kernel unavailable (%s): using one SDPA call per prompt token", exc)
            return TorchAttention()

    def supports(self, head_dim: int) -> bool:
        return head_dim % self.lanes == 0

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, out: torch.Tensor):
        n, q_heads, dim = q.shape
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != dim:
            raise ValueError("q must be float32 rows of contiguous heads")
        if keys.stride(-1) != 1 or keys.stride() != values.stride() or keys.dtype != values.dtype:
            raise ValueError("keys and values must share one layout")
        if keys.shape[-2] < start + n:
            raise ValueError(f"the cache holds {keys.shape[-2]} positions, the queries need {start + n}")
        call = _Call(
            q.data_ptr(),
            q.stride(0),
            n,
            start,
            keys.data_ptr(),
            values.data_ptr(),
            keys.stride(1),
            keys.stride(2),
            int(keys.dtype == torch.bfloat16),
            out.data_ptr(),
            out.stride(0),
            q_heads,
            keys.shape[1],
            dim,
            dim**-0.5,
        )
        status = self._lib.attention(ctypes.byref(call), torch.get_num_threads())
        if status:
            raise RuntimeError("exact attention failed" + (": out of memory" if status == 2 else ""))
        return out


class TorchAttention:
    """The fallback: each query row through the SDPA call a decode step makes for it."""

    name = "torch"

    def supports(self, head_dim: int) -> bool:
        return True

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, out: torch.Tensor):
        n, q_heads, dim = q.shape
        kv_heads = keys.shape[1]
        for r in range(n):
            query = q[r].reshape(1, kv_heads, q_heads // kv_heads, dim).to(keys.dtype)
            end = start + r + 1
            row = F.scaled_dot_product_attention(query, keys[:, :, :end], values[:, :, :end], scale=dim**-0.5)
            out[r].copy_(row.reshape(q_heads, dim))
        return out
