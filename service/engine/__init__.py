"""The engine room: one loaded model serving many requests.

`engine.Engine` admits a request (limits, memory, the queue: `admission`), prepares its prompt
and runs it as a `batching.Sequence` on the one scheduler thread that owns the model: its prefill
in steps (`prefill`: cache lookup, vision encoder, prompt pieces), then decode steps shared with
the batch; `sampling` chooses each token, `streaming` carries the tokens to the request's thread
as text. May import every room below it (model, answer, caches, vision, quant, media, native) and
the top-level modules; nothing but the HTTP layer and the CLI imports it.
"""
