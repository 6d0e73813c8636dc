"""The quantization room: Linear layers on int8 and 4-bit weights, and choosing their kernel.

`int8_linear.Int8Linear` (per-row activations; FBGEMM, oneDNN or the native kernel — the same
bits), `int4_linear.Int4Linear` (4-bit groups, the same per-row activations, the native 4-bit
kernel), `fusion` (q/k/v and gate/up as one Linear each), `quantized` (writing and loading INT8
and 4-bit checkpoints), `published` (GPTQ and AWQ layouts, converted exactly), `packing` (packing
or reading their weights on threads, begun before the app imports), `kernel_choice` (the INT8
kernel measured on this machine). May import native and the basic top-level modules only.
"""
