"""Qwen3.5's linear-attention layers (Gated DeltaNet) in the service's one forward: their state per
sequence and their token mixer, exact by construction (service/native/deltanet.c).

A linear-attention layer keeps no keys and values: each sequence carries a fixed-size state — the
last `kernel - 1` inputs of its causal convolution and a recurrent matrix per value head (dk × dv)
— that every token updates. `RecurrentLayer` holds one sequence's state for one layer;
`DeltaNetMixer` runs one layer for every sequence of a forward call, after its input projection
(one fused Linear: q, k, v, z, b, a) and before its `out_proj`.

A token's output and the state it leaves have the same bits whichever call computes it: alone, in
a batch, in a prefill piece of any length, resumed after a pause or a cache hit (the kernel runs the
recurrence token by token in one fixed order), and on any instruction set (deltanet.c's own vector
code, exp and log). A call that may be taken back (a decode step's verified guesses) writes its new
state beside the old one, so `RecurrentLayer.rewind` keeps only the accepted tokens by recomputing
them from the old state: the bits of a step that never saw the rejected guesses.

Without a C compiler `TorchDeltaNet` computes the same per-token math with torch (each token alone,
so exact across calls too, but slower and not the same bits on every CPU; a warning says so).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import native

log = logging.getLogger(__name__)


class _Layer(ctypes.Structure):
    _fields_ = [
        ("nk", ctypes.c_int),
        ("nv", ctypes.c_int),
        ("dk", ctypes.c_int),
        ("dv", ctypes.c_int),
        ("kernel", ctypes.c_int),
        ("conv_weight", ctypes.c_void_p),
        ("a_log", ctypes.c_void_p),
        ("dt_bias", ctypes.c_void_p),
        ("norm_weight", ctypes.c_void_p),
        ("eps", ctypes.c_float),
    ]


class _Sequence(ctypes.Structure):
    _fields_ = [
        ("n", ctypes.c_int),
        ("qkv", ctypes.c_void_p),
        ("z", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("a", ctypes.c_void_p),
        ("qkv_row", ctypes.c_int64),
        ("z_row", ctypes.c_int64),
        ("b_row", ctypes.c_int64),
        ("a_row", ctypes.c_int64),
        ("conv_before", ctypes.c_void_p),
        ("state_before", ctypes.c_void_p),
        ("conv_state", ctypes.c_void_p),
        ("state", ctypes.c_void_p),
        ("mixed", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("out_row", ctypes.c_int64),
    ]


def is_hybrid(config) -> bool:
    """Whether the text config mixes linear attention in (Qwen3.5): its `layer_types`."""
    return "linear_attention" in (getattr(config, "layer_types", None) or [])


@dataclass(frozen=True)
class Shape:
    """A linear-attention layer's sizes (the checkpoint's text config)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    kernel: int

    @classmethod
    def of(cls, config) -> Shape:
        return cls(
            config.linear_num_key_heads,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
            config.linear_conv_kernel_dim,
        )

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def values(self) -> int:
        return self.value_heads * self.value_dim

    @property
    def projection_widths(self) -> list[int]:
        """The input projections' parts, in row order: q, k, v (convolved together), z; then b, a."""
        return [self.conv_channels, self.values, self.value_heads, self.value_heads]

    @property
    def state_bytes(self) -> int:
        """One sequence's state in this layer, fp32: the recurrent matrices and the convolution's inputs."""
        return 4 * (self.value_heads * self.key_dim * self.value_dim + (self.kernel - 1) * self.conv_channels)


class RecurrentLayer:
    """One sequence's state in one linear-attention layer, and the tokens it has seen (`length`)."""

    def __init__(self, shape: Shape):
        self.shape = shape
        self.conv = torch.zeros(shape.kernel - 1, shape.conv_channels)
        self.state = torch.zeros(shape.value_heads, shape.key_dim, shape.value_dim)
        self.length = 0
        self._before: tuple[torch.Tensor, torch.Tensor] | None = None  # the state before a call that may be undone
        self._inputs: tuple | None = None  # that call's inputs (q/k/v, z, b, a rows)

    def copy(self) -> RecurrentLayer:
        other = RecurrentLayer.__new__(RecurrentLayer)
        other.shape, other.length = self.shape, self.length
        other.conv, other.state = self.conv.clone(), self.state.clone()
        other._before = other._inputs = None
        return other

    def compact(self) -> None:
        """Drop what only an undo needs (a kept state is not extended before a new call)."""
        self._before = self._inputs = None

    def nbytes(self) -> int:
        spare = sum(t.numel() * 4 for t in self._before) if self._before is not None else 0
        return (self.conv.numel() + self.state.numel()) * 4 + spare

    def targets(self, undoable: bool, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv before, state before, conv after, state after) for a call of `inputs`: in place, or,
        when the call may be undone, into the spare buffers (the old state kept for `rewind`)."""
        if not undoable:
            self._inputs = None
            return self.conv, self.state, self.conv, self.state
        if self._before is None:
            self._before = (torch.empty_like(self.conv), torch.empty_like(self.state))
        conv_after, state_after = self._before
        self._before = (self.conv, self.state)
        self.conv, self.state = conv_after, state_after
        self._inputs = inputs
        return self._before[0], self._before[1], self.conv, self.state

    def rewind(self, tokens: int, mixer: DeltaNetMixer) -> None:
        """Take back the last `tokens` tokens of the last call (made undoable): the state becomes the
        one the call's first tokens alone leave, recomputed from the state before it."""
        if tokens <= 0:
            return
        if self._inputs is None:
            raise ValueError("only the last call of a decode step can be taken back")
        qkv, z, b, a = self._inputs
        keep = len(qkv) - tokens
        self.length -= tokens
        if keep <= 0:
            self.conv.copy_(self._before[0])
            self.state.copy_(self._before[1])
        else:
            mixer.run_one(self, (qkv[:keep], z[:keep], b[:keep], a[:keep]), self._before)
        self._inputs = None


class DeltaNetMixer:
    """One linear-attention layer's token mixer: `mixer(states, qkvz, ba, counts, undoable)` for the call's rows."""

    def __init__(self, attention_module, shape: Shape, eps: float, kernel=None):
        self.shape = shape
        weight = attention_module.conv1d.weight.detach().float()  # channels × 1 × kernel
        self.conv_weight = weight[:, 0, :].t().contiguous()  # kernel × channels: a tap's channels side by side
        self.a_log = attention_module.A_log.detach().float().contiguous()
        self.dt_bias = attention_module.dt_bias.detach().float().contiguous()
        self.norm_weight = attention_module.norm.weight.detach().float().contiguous()
        self.eps = eps
        self.kernel = kernel or DeltaNetKernel.load()
        self.native = None  # deltanet.c's view of these weights: made once, by its first call

    def __call__(
        self,
        layers: list[RecurrentLayer],
        qkvz: torch.Tensor,
        ba: torch.Tensor,
        counts: list[int],
        undoable: list[bool],
    ):
        """The mixed values (rows × value heads·dv) of the call's rows — their input projections `qkvz`
        (q, k, v, z) and `ba` (b, a) — `counts[i]` consecutive rows for sequence i, each sequence's state
        advanced in `layers[i]`; `undoable[i]`: sequence i's rows may be taken back (RecurrentLayer.rewind)."""
        widths = self.shape.projection_widths
        parts = (*qkvz.split(widths[:2], dim=-1), *ba.split(widths[2:], dim=-1))
        out = torch.empty(len(qkvz), self.shape.values)
        calls, at = [], 0
        for layer, count, may_undo in zip(layers, counts, undoable):
            # one sequence (a decode step's usual call): its rows are the call's, no views to make
            inputs = parts if count == len(qkvz) else tuple(p[at : at + count] for p in parts)
            rows = out if count == len(qkvz) else out[at : at + count]
            calls.append((layer, inputs, layer.targets(may_undo, inputs), rows))
            layer.length += count
            at += count
        self.kernel(self, calls)
        return out

    def run_one(self, layer: RecurrentLayer, inputs: tuple, before: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Recompute `inputs` from the state `before` into `layer`'s buffers (the output is dropped)."""
        targets = (before[0], before[1], layer.conv, layer.state)
        self.kernel(self, [(layer, inputs, targets, torch.empty(len(inputs[0]), self.shape.values))])


class DeltaNetKernel:
    """deltanet.c, built for this CPU (or NATIVE_MARCH / `march`)."""

    name = "c"

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        self._lib.deltanet.argtypes = [ctypes.POINTER(_Layer), ctypes.POINTER(_Sequence), ctypes.c_int, ctypes.c_int]
        self._lib.deltanet.restype = ctypes.c_int

    @classmethod
    @functools.cache
    def load(cls, march: str | None = None) -> DeltaNetKernel | TorchDeltaNet:
        try:
            return cls(native.library(native.DELTANET, march))
        except native.BUILD_ERRORS as exc:
            log.warning(
                "the DeltaNet kernel is unavailable (%s): torch per token, slower and not the same bits on every CPU",
                exc,
            )
            return TorchDeltaNet()

    def __call__(self, mixer: DeltaNetMixer, calls: list) -> None:
        s = mixer.shape
        if mixer.native is None:
            mixer.native = _Layer(
                s.key_heads,
                s.value_heads,
                s.key_dim,
                s.value_dim,
                s.kernel,
                mixer.conv_weight.data_ptr(),
                mixer.a_log.data_ptr(),
                mixer.dt_bias.data_ptr(),
                mixer.norm_weight.data_ptr(),
                mixer.eps,
            )
        sequences = (_Sequence * len(calls))()
        width = s.conv_channels + 2 * s.value_heads
        scratch = torch.empty(sum(len(inputs[0]) for _, inputs, _, _ in calls), width)  # every sequence's, in turn
        mixed = scratch.data_ptr()
        for slot, (_, (qkv, z, b, a), (conv_before, state_before, conv, state), out) in zip(sequences, calls):
            for t in (qkv, z, b, a, out):
                if t.dtype != torch.float32 or t.stride(-1) != 1:
                    raise ValueError("the mixer takes float32 rows")
            slot.n = len(qkv)
            slot.qkv, slot.z, slot.b, slot.a = qkv.data_ptr(), z.data_ptr(), b.data_ptr(), a.data_ptr()
            slot.qkv_row, slot.z_row, slot.b_row, slot.a_row = qkv.stride(0), z.stride(0), b.stride(0), a.stride(0)
            slot.conv_before, slot.state_before = conv_before.data_ptr(), state_before.data_ptr()
            slot.conv_state, slot.state = conv.data_ptr(), state.data_ptr()
            slot.mixed, slot.out, slot.out_row = mixed, out.data_ptr(), out.stride(0)
            mixed += 4 * slot.n * width
        failed = self._lib.deltanet(ctypes.byref(mixer.native), sequences, len(calls), torch.get_num_threads())
        if failed:
            raise ValueError(f"the DeltaNet kernel refused the call (code {failed}): sizes must be multiples of 16")


class TorchDeltaNet:
    """The kernel's math with torch ops, one token at a time (see the module docstring)."""

    name = "torch"

    def __call__(self, mixer: DeltaNetMixer, calls: list) -> None:
        s = mixer.shape
        group = s.value_heads // s.key_heads
        decay_rate = -mixer.a_log.exp()
        for _, (qkv, z, b, a), (conv_before, state_before, conv, state), out in calls:
            window, recurrent = conv_before.clone(), state_before.clone()
            for t in range(len(qkv)):
                taps = torch.cat([window, qkv[t : t + 1]])  # kernel × channels
                window = taps[1:]
                mixed = F.silu((taps * mixer.conv_weight).sum(0))
                q, k, v = mixed.split([s.key_heads * s.key_dim, s.key_heads * s.key_dim, s.values])
                q, k = (x.view(s.key_heads, s.key_dim) for x in (q, k))
                q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) / s.key_dim**0.5
                k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
                q, k = q.repeat_interleave(group, 0), k.repeat_interleave(group, 0)
                v = v.view(s.value_heads, s.value_dim)
                decay = (decay_rate * F.softplus(a[t] + mixer.dt_bias)).exp()[:, None, None]
                beta = b[t].sigmoid()[:, None]
                recurrent = recurrent * decay
                delta = (v - (recurrent * k[:, :, None]).sum(1)) * beta
                recurrent = recurrent + k[:, :, None] * delta[:, None, :]
                o = (recurrent * q[:, :, None]).sum(1)
                o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + mixer.eps) * mixer.norm_weight
                out[t] = (o * F.silu(z[t].view(s.value_heads, s.value_dim))).flatten()
            conv.copy_(window)
            state.copy_(recurrent)
