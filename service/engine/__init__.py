"""The engine room: one loaded model serving many requests.

`engine.Engine` takes a request through the input side (`input`: checks, prompt, token limit,
grammar, memory) and admission (`admission`: limits, the queue, preemption), then runs it as a
`sequence.Sequence` on the one scheduler thread that owns the model (`scheduler`: continuous
batching): its prefill in steps (`prefill`: cache lookup, vision encoder, prompt pieces), then
decode steps shared with the batch, verifying guessed tokens (`drafts`; `mtp_drafts`: those of a
checkpoint's multi-token prediction head); `sampling` chooses each token, `reasoning` follows a
thinking model's reasoning, `streaming` carries the tokens to the request's thread and `output` turns
them into its events. `search` runs embedding and rerank requests (Qwen3-VL-Embedding, -Reranker) on
the same model: many inputs a forward, their shared head once; `search_reference` is the official
code's reading of them, to compare with (never serves). May import every room below it (caches,
model, answer, vision, random_checkpoints, quant, media, native, jobs) and the top-level modules;
nothing but the HTTP layer and the CLI imports it.
"""
