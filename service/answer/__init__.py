"""The answer-shape room: what an answer must look like and what is reported of it — `structured`
(JSON Schema grammars enforced per token with llguidance), `tools` (Qwen's tool-call format,
parsed from the text), `logprobs` (log-probabilities as OpenAI reports them), `stops` (stop
strings). Imports only the basic top-level modules.
"""
