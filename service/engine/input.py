"""The input side: a request checked and prepared before it queues for the model — its prompt
tokenized and patchified, its token limit, its grammar compiled, its memory checked — so every 4xx
and 503 is raised before a byte of the answer is sent."""

from __future__ import annotations

from dataclasses import dataclass

from ..answer.structured import Constraint, GrammarCompiler
from ..errors import BadRequest, PromptTooLong
from ..generation import GenerationRequest
from ..limits import RequestLimits
from ..memory import MemoryGuard, kv_cache_bytes
from ..model.kv import headroom
from ..model.prompts import PreparedPrompt, prepare_prompt, renders_tools, tool_call_form
from ..model.thinking import SWITCH, Opening, ThinkingTokens


@dataclass(frozen=True)
class Prepared:
    """What the input side worked out for one request."""

    prompt: PreparedPrompt
    max_new_tokens: int
    constraint: Constraint | None  # the grammar's state, fresh, if the request has one
    reasoning: tuple[Opening, int | None] | None = None  # a thinking model's: how the answer opens, its budget


class InputProcessor:
    """Checks and prepares requests for one loaded model (`loaded`: a LoadedModel; `thinking`: its
    thinking tokens, None for a model that does not think)."""

    def __init__(
        self,
        loaded,
        limits: RequestLimits,
        memory: MemoryGuard,
        kv_itemsize: int,
        thinking: ThinkingTokens | None,
        head_layers: int = 0,
    ):
        self.processor = loaded.processor
        self.config = loaded.model.config
        self.limits = limits
        self.memory = memory
        self.kv_itemsize = kv_itemsize
        self.head_layers = head_layers  # a multi-token prediction head's, whose keys and values a sequence keeps too
        self.vocab_size = getattr(self.config, "text_config", self.config).vocab_size
        self.grammars = GrammarCompiler(self.processor.tokenizer, self.vocab_size, loaded.eos_token_ids)
        self.renders_tools = renders_tools(self.processor)
        self.thinking = thinking
        self.tool_form = tool_call_form(self.processor)  # how its calls are written: Qwen3-VL's JSON, Qwen3.5's XML

    def prepare(self, request: GenerationRequest) -> Prepared:
        """Check the request and prepare it; raises the 4xx (or the 503) a client should get."""
        params = request.params
        if len(params.stop) > self.limits.max_stop_strings:
            raise BadRequest(f"stop may hold at most {self.limits.max_stop_strings} strings", param="stop")
        if any(not 0 <= token < self.vocab_size for token in params.logit_bias or {}):
            raise BadRequest(f"logit_bias keys must be token ids from 0 to {self.vocab_size - 1}", param="logit_bias")
        if request.max_thinking_tokens is not None and request.max_thinking_tokens < 0:
            raise BadRequest("max_thinking_tokens must be 0 or more", param="max_thinking_tokens")
        prompt = self.prompt(request)
        max_new_tokens = self._max_new_tokens(prompt, params.max_tokens)
        constraint = self.grammars.constraint(request.grammar) if request.grammar else None
        self._check_memory(prompt, max_new_tokens)
        return Prepared(prompt, max_new_tokens, constraint, self._reasoning(request, prompt))

    def prompt(self, request: GenerationRequest) -> PreparedPrompt:
        """The request's prompt: its chat template rendered (tools, the thinking switch), tokenized,
        its pictures and clips patchified."""
        if request.tools and not self.renders_tools:
            raise BadRequest("this checkpoint's chat template does not render tools", param="tools")
        switch_off = self.thinking is not None and self.thinking.has_switch and not request.enable_thinking
        template_kwargs = {SWITCH: False} if switch_off else None
        return prepare_prompt(
            self.processor,
            request.messages,
            self.limits.prompt,
            request.tools,
            template_kwargs,
            xml_calls=self.tool_form.xml,
        )

    def _reasoning(self, request: GenerationRequest, prompt: PreparedPrompt) -> tuple[Opening, int | None] | None:
        """How a thinking model's answer opens, and its thinking budget: thinking switched off where
        the template has no switch is a budget of 0 (the service closes the block at once)."""
        if self.thinking is None:
            return None
        opening = self.thinking.opening(prompt.text)
        if opening is Opening.ANSWER:
            return None
        return opening, 0 if not request.enable_thinking else request.max_thinking_tokens

    def _max_new_tokens(self, prompt: PreparedPrompt, wanted: int | None) -> int:
        room = self.limits.prompt.context_limit - prompt.num_tokens
        if room < 1:
            raise PromptTooLong(
                f"the prompt is {prompt.num_tokens} tokens; the context limit is {self.limits.prompt.context_limit}",
                param="messages",
            )
        return max(1, min(wanted or self.limits.default_max_tokens, self.limits.max_new_tokens, room))

    def _check_memory(self, prompt: PreparedPrompt, max_new_tokens: int) -> None:
        """Unavailable (503) if this request's KV cache would not fit the memory budget, caches evicted first."""
        tokens = prompt.num_tokens + max_new_tokens
        tokens += headroom(tokens)  # GrowingCache's room
        self.memory.check(kv_cache_bytes(self.config, tokens, self.kv_itemsize, self.head_layers))
