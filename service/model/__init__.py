"""The model room: a Qwen3-VL checkpoint as the service runs it.

`loading` builds the processor and the model (a checkpoint, an INT8 one, or the embedded random
test model `checkpoints` makes); `prompts` turns chat messages into token ids and patches with the
checkpoint's chat template (and marks each picture's token span, `VisionSpan`); `forward` is the
text decoder's one forward for prefill pieces, decode steps and batches, with `attention` (the
exact kernel, service/native/attention.c) and `kv` (a sequence's keys and values, grown in place).
May import answer, vision, quant, media, native and the basic top-level modules.
"""
