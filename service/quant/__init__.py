"""The quantization room: Linear layers on int8 and 4-bit weights, choosing their kernel, and the
quantized checkpoints they are written to and loaded from.

The layers: `int8_linear.Int8Linear` (per-row activations; FBGEMM, oneDNN or the native kernel — the
same bits), `int4_linear.Int4Linear` (4-bit groups, the same per-row activations, the native 4-bit
kernel), `fusion` (q/k/v and gate/up as one Linear each), `kernel_choice` (the INT8 kernel measured
on this machine). Quantizing: `structure` (the model's blocks, Linears and embedding as quantizing
sees them), `in_place` (a loaded model made INT8 at load). The checkpoints: `packing` (their format:
marker, tensor names, aligned files, packing or reading their weights on threads), `source_tensors`
(a checkpoint's safetensors read a tensor at a time), `writer` (`quantize` and `make-model --bits`),
`estimates` (a checkpoint's bytes from its config alone), `conversion` (format 1 and published ones
converted once), `published` (GPTQ and AWQ layouts, converted exactly), `loader` (a quantized
checkpoint mapped and used in place). May import native and the basic top-level modules only.
"""
