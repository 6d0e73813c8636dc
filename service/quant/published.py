"""Published 4-bit checkpoints: GPTQ and AWQ safetensors layouts, read as the 4-bit layers' own values.

Both store a Linear as int32 words of eight 4-bit values (`qweight`), zero points packed the same
way (`qzeros`) and fp16 `scales`, per group of inputs; the weight is scales·(value − zero), exactly
the form of service/quant/int4_linear.py, so the conversion is exact (no rounding anywhere):

- GPTQ (`quant_method: gptq`; AutoGPTQ, GPTQModel, optimum): `qweight` [in/8, out] packs along the
  inputs, `qzeros` [groups, out/8] along the outputs, both low nibble first; format "gptq" (v1)
  stores each zero point minus one, "gptq_v2" as is. `g_idx` [in] gives each input's group.
- AWQ (`quant_method: awq`, version "gemm"; AutoAWQ): `qweight` [in, out/8] and `qzeros`
  [groups, out/8] pack along the outputs, in the interleaved order 0 2 4 6 1 3 5 7.

A mixture of experts is read the same way when each expert is stored as its own Linears
(`mlp.experts.E.gate_proj`, `up_proj`, `down_proj`: GPTQModel's and AutoAWQ's layout, the one vLLM
reads); a quantized router (`mlp.gate`) is read back as its float matrix (int4_linear.dequantize: exact,
a 5-bit integer times an fp16 scale needs at most 16 of fp32's 24 bits).

What does not fit that form is refused with a clear error: other bit widths, act-order GPTQ
(`g_idx` not in input order), AWQ's GEMV layout, other quantization methods.
"""

from __future__ import annotations

import torch

METHODS = ("gptq", "awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output 8j + AWQ_ORDER[i]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


class UnsupportedCheckpoint(ValueError):
    """A published quantized checkpoint this service cannot read exactly."""


def scheme(config: dict) -> dict | None:
    """The checkpoint's `quantization_config` if it is GPTQ or AWQ; None if it has none; an error for
    any other method or a form this service does not read."""
    qc = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise UnsupportedCheckpoint(
            f"quantization method {method or '(none)'!r} is not supported: this service reads GPTQ and AWQ "
            "4-bit checkpoints, or quantizes an unquantized one itself (`python -m service quantize`)"
        )
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise UnsupportedCheckpoint(f"{method.upper()} with {bits} bits is not supported: only 4-bit weights")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise UnsupportedCheckpoint(f"AWQ version {qc.get('version')!r} is not supported: only the GEMM layout")
    if method == "awq" and qc.get("zero_point") is False:
        raise UnsupportedCheckpoint("AWQ without zero points is not supported")
    if method == "gptq" and str(qc.get("checkpoint_format", "gptq")).lower() not in ("gptq", "gptq_v2"):
        raise UnsupportedCheckpoint(f"GPTQ checkpoint format {qc.get('checkpoint_format')!r} is not supported")
    return {**qc, "quant_method": method}


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., w] → uint8 [..., 8w]: each word's eight 4-bit values, low nibble first."""
    return ((words.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 15).to(torch.uint8).flatten(-2)


def unpack(tensors: dict[str, torch.Tensor], qc: dict, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values u8 [out, in], zeros u8 [out, groups], fp16 scales [out, groups]) of the published Linear
    `name` (its `qweight`, `qzeros`, `scales` and, for GPTQ, `g_idx` in `tensors`)."""
    qweight, qzeros, scales = (tensors[f"{name}.{t}"] for t in ("qweight", "qzeros", "scales"))
    groups = scales.shape[0]
    if qc["quant_method"] == "gptq":
        values = _nibbles(qweight.T)  # [out, in]
        zeros = _nibbles(qzeros)  # [groups, out]
        if str(qc.get("checkpoint_format", "gptq")).lower() == "gptq":
            zeros += 1  # v1 stores zero − 1 (a stored 15 is 16, as GPTQ's own kernels compute it: u8 holds it)
        in_features = values.shape[1]
        g_idx = tensors.get(f"{name}.g_idx")
        if g_idx is not None:
            in_order = torch.arange(in_features) // (in_features // groups)
            if not torch.equal(g_idx.to(torch.int64), in_order):
                raise UnsupportedCheckpoint(
                    f"{name}: act-order GPTQ (desc_act: g_idx not in input order) is not supported; "
                    "quantize with desc_act=False"
                )
    else:
        order = torch.tensor(AWQ_ORDER).argsort()  # output column c of a word is nibble order[c]
        values = _nibbles(qweight).unflatten(-1, (-1, 8))[..., order].flatten(-2).T  # [out, in]
        zeros = _nibbles(qzeros).unflatten(-1, (-1, 8))[..., order].flatten(-2)
    out_features = scales.shape[1]
    values, zeros = values[:out_features], zeros[:, :out_features]
    return values.contiguous(), zeros.T.contiguous(), scales.T.to(torch.float16).contiguous()


def quantized_linears(names) -> set[str]:
    """The Linears (names without a suffix) a published checkpoint stores as 4-bit."""
    return {n[: -len(".qweight")] for n in names if n.endswith(".qweight")}
