"""A mixture-of-experts MLP (Qwen3-VL-MoE) in the service's one forward, each row's bits its own.

transformers' layer: the router's logits (a float matrix, hidden → experts), a softmax in fp32, the
top k experts of each token, their probabilities renormalised over the k, and the sum of the k
experts' MLPs weighted by them. Here the same math, computed so that a token's result never depends
on the other rows of the call (a decode batch, a prefill piece, a verify pass):

- the router's logits come from `service/native/router.c`, whose float sums run in one order fixed
  by the hidden size alone (a float GEMM's rounding changes with the number of rows, and a near tie
  between two experts would then choose others); without a C compiler, one row at a time;
- softmax (service/native/float_ops.py: the same bits on every CPU), top-k and the renormalisation
  (the k probabilities added in rank order) work on each row alone;
- the call's rows are grouped by expert — one call of an expert's gate/up and down Linears over
  all the rows routed to it (service/quant/fusion.py's `ExpertLinears`; INT8 and 4-bit quantize
  their input per row, so a row's output does not depend on the rows beside it);
- each row then adds its experts' weighted outputs in its own rank order (first choice, second, …),
  whatever experts its neighbours chose.

transformers adds a token's experts in expert-number order: the two agree within float rounding
(tests/test_moe.py), and with INT8 or 4-bit experts a token has the same bits alone, in a batch,
in pieces and after a cache hit.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
from torch import nn

from .. import native
from ..native import float_ops
from ..quant.int4_linear import Int4Experts, Int4Linear

log = logging.getLogger(__name__)


@functools.cache
def _library(march: str | None = None):
    """router.c built for this CPU, or for `march` (None without a compiler: one row at a time)."""
    try:
        arguments = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 4
        return native.typed_library(native.ROUTER, {"router_logits": (arguments, None)}, march)
    except native.BUILD_ERRORS as exc:
        log.warning("the router kernel is unavailable (%s): routing one row at a time, exact and slower", exc)
        return None


def router_logits(x: torch.Tensor, weight: torch.Tensor, march: str | None = None) -> torch.Tensor:
    """x (rows × hidden, fp32) · weightᵀ (experts × hidden), each row's sums in a fixed order (the
    kernel built for this CPU, or for gcc's `march`: the same bits; "fallback": the torch path)."""
    x = x.float().contiguous()
    weight = weight.float().contiguous()
    lib = None if march == "fallback" else _library(march)
    if lib is None:  # every row through the same one-row computation: its bits do not depend on the call
        return torch.stack([(weight * row).sum(-1) for row in x]) if len(x) else x.new_empty(0, len(weight))
    y = torch.empty(x.shape[0], weight.shape[0])
    lib.router_logits(
        x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(), *y.shape, x.shape[1], torch.get_num_threads()
    )
    return y


def all_int4(*linears: list[nn.Module]) -> bool:
    return all(isinstance(linear, Int4Linear) for group in linears for linear in group)


class MixtureOfExperts:
    """One decoder layer's sparse MLP as the forward runs it: `moe(h)` for rows h (rows × hidden)."""

    def __init__(self, block: nn.Module):
        self.router = block.gate.weight.detach().float().contiguous()  # experts × hidden, kept in fp32
        # Qwen3.5's shared expert: its gate's row is computed with the router's (the same fixed-order sums)
        self.shared = getattr(block, "shared_expert", None)
        if self.shared is not None:
            self.router = torch.cat([self.router, block.shared_expert_gate.weight.detach().float()]).contiguous()
        self.top_k = block.gate.top_k
        self.gate_up = list(block.experts.gate_up)
        self.down = list(block.experts.down)
        self.act = float_ops.Activation(float_ops.SILU)  # the experts' act_fn (SiLU), in fixed order
        self.experts = len(self.gate_up)  # routed ones
        # 4-bit experts: all of them in one native call per layer (int4_gemm.c's `int4_experts`)
        self.int4 = Int4Experts(self.gate_up, self.down) if all_int4(self.gate_up, self.down) else None
        if getattr(block.gate, "norm_topk_prob", True) is False:
            raise ValueError("a router that does not renormalise its top-k probabilities: not a Qwen3-VL-MoE one")

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(weights, experts), rows × top_k each, in rank order: transformers' router; and the shared
        expert's gate logit per row (None without a shared expert)."""
        logits = router_logits(h, self.router)
        shared = logits[:, self.experts :] if self.shared is not None else None
        probabilities = float_ops.softmax(logits[:, : self.experts])
        weights, chosen = torch.topk(probabilities, self.top_k, dim=-1)
        total = weights[:, :1].clone()
        for rank in range(1, self.top_k):  # the sum in rank order (a reduction's order follows the CPU)
            total += weights[:, rank : rank + 1]
        return weights / total, chosen, shared

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        weights, chosen, shared = self.route(h)
        routed = self._routed(h, weights, chosen)
        if shared is None:
            return routed
        gate, up = self.shared.gate_up_proj(h).chunk(2, dim=-1)
        return routed + float_ops.sigmoid(shared) * self.shared.down_proj(float_ops.silu_mul(gate, up))

    def _routed(self, h: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        rows, hidden = h.shape
        if self.int4 is not None:
            return self.int4(h, weights, chosen)
        slots = chosen.flatten()  # slot row·k + rank: the rank-th expert of the row
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=self.experts).tolist()
        outputs = torch.empty(rows * self.top_k, hidden)
        at = 0
        for expert, count in enumerate(counts):  # one call of each expert over all its rows
            if count == 0:
                continue
            mine = order[at : at + count]
            at += count
            gate, up = self.gate_up[expert](h[mine // self.top_k]).chunk(2, dim=-1)
            outputs[mine] = self.down[expert](float_ops.silu_mul(gate, up))
        outputs = outputs.view(rows, self.top_k, hidden)
        total = outputs[:, 0] * weights[:, :1]
        for rank in range(1, self.top_k):  # each row's experts in its own rank order
            total += outputs[:, rank] * weights[:, rank : rank + 1]
        return total
