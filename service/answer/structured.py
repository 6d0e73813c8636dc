"""Structured output: a grammar the answer must follow, enforced token by token with llguidance.

A request's `OutputGrammar` is a Lark grammar whose rules may embed JSON Schemas (`%json {...}`):
a response_format is one such rule, a forced tool call is Qwen's <tool_call> tags around one
(service/answer/tools.py). `GrammarCompiler` turns it into a matcher once — the lexer over the whole
vocabulary is the expensive part — and keeps it by grammar text, so a schema seen before costs a
copy. Each constrained sequence gets its own `Constraint`: before each token it says which token
ids may come next (the sampler sets the rest to -inf), after it consumes the chosen one. Nothing
is shared between sequences, so an unconstrained neighbour in the batch is untouched.

llguidance was chosen over xgrammar by measurement (bench/bench_structured.py): per-token masks on
this CPU and compile times are both small, and llguidance is a 3 MB wheel with no dependencies where
xgrammar pulls in triton (~1 GB).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.hf
import numpy as np
import torch

from .. import metrics
from ..errors import BadRequest

log = logging.getLogger(__name__)

# JSON as json.dumps writes it (and so as chat templates render it back): ", " and ": ", no other
# whitespace. Flexible whitespace would let a model pad an answer with newlines until max_tokens.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

MAX_GRAMMAR_BYTES = 256 * 1024  # a grammar's text (schemas included); beyond it: 400
# Bounds on what one client grammar may cost (llguidance's defaults allow 250,000 lexer states), and
# CACHED_GRAMMARS of them are kept.
PARSER_LIMITS = dict(max_lexer_states=20_000, max_grammar_size=100_000, initial_lexer_fuel=1_000_000)
CACHED_GRAMMARS = 16


@dataclass(frozen=True)
class OutputGrammar:
    """What an answer must match: Lark text, and the request field it came from (named in errors)."""

    lark: str
    param: str


def json_rule(schema: dict) -> str:
    """A Lark rule body matching JSON valid against `schema`, written in JSON_STYLE."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)


# Where a JSON Schema holds further schemas: one, a list of them, or a map of names to them.
_SUBSCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames")
_SUBSCHEMA += ("unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema):
    """OpenAI's strict mode: `schema` with every object schema that does not say otherwise
    allowing no keys beyond its properties (JSON Schema's own default allows any, and a grammar
    following it lets a model open extra keys it may never close)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    open_keys = ("additionalProperties", "unevaluatedProperties", "patternProperties")
    if is_object and not any(key in out for key in open_keys):
        out["additionalProperties"] = False
    return out


def json_grammar(schema: dict, param: str) -> OutputGrammar:
    """Answers that are JSON valid against `schema`."""
    return OutputGrammar(f"start: {json_rule(schema)}\n", param)


class Constraint:
    """One sequence's grammar state: `allowed()` before a token, `advance(token)` after it."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: frozenset[int]):
        self._matcher = matcher
        self._vocab = vocab_size
        self._eos = sorted(eos_ids)

    def allowed(self) -> torch.Tensor:
        """A bool mask over the vocabulary: the tokens the grammar accepts next (end of turn once
        it is complete)."""
        if self._matcher.is_error():  # never expected: end the answer rather than hang
            log.error("grammar matcher failed: %s", self._matcher.get_error())
            allowed = torch.zeros(self._vocab, dtype=torch.bool)
            allowed[self._eos] = True
            return allowed
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little", count=self._vocab).view(np.bool_))

    def advance(self, token: int) -> bool:
        """Consume the chosen token; False if the grammar refused it (logged: the mask forbids that)."""
        if self._matcher.consume_token(token) or token in self._eos:
            return True
        log.error("grammar matcher refused token %d: %s", token, self._matcher.get_error())
        return False

    def forced(self) -> list[int]:
        """The tokens the grammar allows as the only continuation from here (llguidance's
        fast-forward: a key's quotes and name, punctuation, the rest of an enum value)."""
        if self._matcher.is_error() or self._matcher.is_accepting():
            return []
        return list(self._matcher.compute_ff_tokens())

    @property
    def complete(self) -> bool:
        """The text so far is a whole match (a JSON document closed, a tool call ended)."""
        return self._matcher.is_accepting()


class GrammarCompiler:
    """Compiles OutputGrammars for one tokenizer and keeps the last CACHED_GRAMMARS (thread-safe;
    a compile runs outside the lock, so cache hits never wait behind one)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.2 s)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=sorted(self.eos_ids)
                )
            return self._tokenizer

    def constraint(self, grammar: OutputGrammar) -> Constraint:
        """A fresh Constraint for `grammar`; BadRequest (naming grammar.param) if it cannot compile."""
        with self._lock:
            template = self._compiled.get(grammar.lark)
            if template is not None:
                self._compiled.move_to_end(grammar.lark)
        if template is None:
            try:
                template = self._compile(grammar)
            except BadRequest:
                metrics.GRAMMARS.labels("invalid").inc()
                raise
            metrics.GRAMMARS.labels("compiled").inc()
            with self._lock:
                self._compiled[grammar.lark] = template
                while len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        else:
            metrics.GRAMMARS.labels("hit").inc()
        return Constraint(template.deep_copy(), self.vocab_size, self.eos_ids)

    def _compile(self, grammar: OutputGrammar) -> llguidance.LLMatcher:
        if len(grammar.lark.encode()) > MAX_GRAMMAR_BYTES:
            raise BadRequest(
                f"the schema is over {MAX_GRAMMAR_BYTES // 1024} KiB", param=grammar.param, code="invalid_schema"
            )
        text = llguidance.LLMatcher.grammar_from_lark(grammar.lark)  # never raises: errors show below
        matcher = llguidance.LLMatcher(
            self.tokenizer(), text, log_level=0, limits=llguidance.LLParserLimits(**PARSER_LIMITS)
        )
        if matcher.is_error():
            raise _cannot_enforce(matcher.get_error(), grammar)
        return matcher


def check_grammar(grammar: OutputGrammar) -> None:
    """BadRequest if `grammar` could not compile for any tokenizer: checked without one, so a command
    line refuses a bad schema before it loads a model."""
    text = llguidance.LLMatcher.grammar_from_lark(grammar.lark)
    error = llguidance.LLMatcher.validate_grammar(text, None)
    if error:
        raise _cannot_enforce(error, grammar)


def _cannot_enforce(error: str, grammar: OutputGrammar) -> BadRequest:
    message = " ".join(error.strip().splitlines())[:500]
    return BadRequest(f"this schema cannot be enforced: {message}", param=grammar.param, code="invalid_schema")
