"""The model room: a Qwen3-VL or Qwen3.5 checkpoint as the service runs it.

`loading` builds the processor and the model — a checkpoint (`weights`: its tensors into the
service's own modules, `skeleton`), a quantized one, or the embedded random test model — and
`prefault` brings a mapped checkpoint's pages in before the first requests; `identity` names the
weights for caches kept outside the process. `processor` is the service's own Qwen3-VL processor,
`prompts` turns chat messages into token ids and patches with the checkpoint's chat template (and
marks each picture's token span, `VisionSpan`), `positions` gives their M-RoPE positions, and
`thinking` recognises a Thinking checkpoint and `task` an embedding or reranker one
(Qwen3-VL-Embedding, -Reranker), whose prompts `search_prompts` writes as their official code does.
`forward` is the text decoder's one forward for prefill pieces, decode steps and batches, with
`attention` (the exact kernel, service/native/attention.c), `moe` (a mixture of experts' MLP),
`deltanet` (Qwen3.5's linear-attention layers and their recurrent state, service/native/deltanet.c),
`mtp` (Qwen3.5's multi-token prediction head: what it computes and the keys and values it keeps per
sequence) and `kv` (a sequence's keys and values, grown in place; `hybrid`: a hybrid model's, with its
recurrent states and their snapshots). May import random_checkpoints, answer, vision, quant, media,
native and the basic top-level modules.
"""
