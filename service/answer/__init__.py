"""The answer-shape room: what an answer must look like and what is reported of it — `structured` (JSON
Schema grammars enforced per token with llguidance), `tools` (Qwen3-VL's tool-call format, parsed
from the text), `xml_tools` (Qwen3.5's XML form of it), `tool_forms` (which form a checkpoint
writes), `grounding` (the boxes an answer names, in the picture's pixels), `logprobs` (log-
probabilities as OpenAI reports them), `stops` (stop strings), `digest` (an answer's fingerprint: its
tokens and logprob bits). Imports only the basic top-level modules.
"""
