"""The random checkpoints room: checkpoints with real shapes and random weights, for tests and
benchmarks, out of the serving model room — `presets` (each `make-model` preset in one table: a
model family's presets are entries of it), `make` (`make_checkpoint`: a preset written as a real
checkpoint, or straight into the INT8 / 4-bit format), `random_weights` (the one generator of their
weights, tensor by tensor), `tokenizer` (a byte-level BPE trained for them), `chat_templates`
(Qwen3-VL's Instruct and Thinking prompt formats), `qwen35` (Qwen3.5's presets, added tokens and prompt
format), `safetensors_writer` (their shards, written in
pieces), `marker` (how a random checkpoint says it is one), `embedded` (the tiny one the service
loads when MODEL_PATH is unset, built once). May import quant (its checkpoint writer and size
estimates), native and the basic top-level modules.
"""
