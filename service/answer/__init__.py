"""The answer-shape room: what an answer must look like and what is reported of it — `structured`
(JSON Schema grammars enforced per token with llguidance), `tools` (Qwen's tool-call format,
parsed from the text), `grounding` (the boxes an answer names, in the picture's pixels), `logprobs`
(log-probabilities as OpenAI reports them), `stops` (stop strings). Imports only the basic
top-level modules.
"""
