"""The INT8 room: Linear layers on int8 weights, and choosing their kernel.

`int8_linear.Int8Linear` (per-row activations; FBGEMM, oneDNN or the native kernel — the same
bits), `fusion` (q/k/v and gate/up as one Linear each), `quantized` (writing and loading INT8
checkpoints), `packing` (packing their weights on threads, begun before the app imports),
`kernel_choice` (the kernel measured on this machine). May import native and the basic
top-level modules only.
"""
