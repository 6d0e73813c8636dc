"""What a JSON-Schema constraint costs: grammar engines compared on this CPU (per-token mask, compile
time, JSON-Schema coverage), then the service's decode speed with and without a schema, alone and
in a batch of 4 where one stream is constrained.

    flock /tmp/heavy.lock python -m bench.bench_structured      # 2B-shaped INT8 checkpoint
    python -m bench.bench_structured --tiny --no-save           # quick run on the embedded model

xgrammar is measured only if installed (`pip install xgrammar`: it pulls triton, ~1 GB); the
service uses llguidance.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bench.core.harness import parse, parser
from bench.core.inputs import RECEIPT
from bench.core.results import markdown_table, report
from bench.core.session import Session

# A stream that must write at least `--tokens` tokens before its JSON may close: decode speeds compare.
LONG_TEXT = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 2000}},
    "required": ["text"],
    "additionalProperties": False,
}

# (feature, schema, a valid instance, an invalid one): enforced if it compiles, the valid instance
# is accepted token by token and the invalid one is not (an engine that ignores a keyword accepts both).
COVERAGE = [
    (
        "enum, const",
        {"type": "object", "properties": {"a": {"enum": [1, "x"]}, "b": {"const": True}}},
        {"a": "x", "b": True},
        {"a": 2},
    ),
    ("string length, pattern", {"type": "string", "minLength": 2, "maxLength": 5, "pattern": "^a+b$"}, "aab", "abc"),
    ("integer bounds", {"type": "integer", "minimum": -5, "exclusiveMaximum": 100}, 99, 100),
    ("number bounds", {"type": "number", "minimum": 0, "maximum": 10}, 7.5, 12.5),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, 7.5, 7.25),
    (
        "array min/maxItems",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
        [1, 2],
        [1, 2, 3, 4],
    ),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]}, ["a", 1], [1, "a"]),
    ("anyOf", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, 5, True),
    ("oneOf", {"oneOf": [{"type": "string"}, {"type": "null"}]}, None, 1),
    (
        "allOf",
        {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
        {"a": 1},
        {"b": 1},
    ),
    (
        "$ref / $defs",
        {"$defs": {"p": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/p"}},
        [3],
        ["x"],
    ),
    (
        "recursive $ref",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        {"kids": [{"kids": []}]},
        {"kids": [{"x": 1}]},
    ),
    (
        "additionalProperties schema",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"k": 1},
        {"k": "v"},
    ),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, {"x1": 2}, {"x1": "a"}),
    ("format date-time", {"type": "string", "format": "date-time"}, "2026-12-01T10:00:00Z", "yesterday"),
    ("format email", {"type": "string", "format": "email"}, "a@b.io", "not an email"),
    ("type list (nullable)", {"type": ["string", "null"]}, None, 1),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    ("if / then / else", {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}}, 3, -1),
    ("not", {"not": {"type": "string"}}, 1, "s"),
]


def _compact(value) -> str:
    return json.dumps(value, ensure_ascii=False)  # ", " and ": ": the style the service enforces


# -- grammar engines --------------------------------------------------------------------------


class LLGuidance:
    """The service's own path: GrammarCompiler (its cache) and Constraint."""

    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, eos: list[int]):
        from service.answer.structured import GrammarCompiler

        self.vocab, self.eos = vocab, eos
        self.compiler = GrammarCompiler(tokenizer, vocab, eos)
        t0 = time.perf_counter()
        self.compiler.tokenizer()
        self.setup_s = time.perf_counter() - t0

    def compile(self, schema):
        """The first request's work (raises on a schema it refuses); then `fresh` takes copies."""
        from service.answer.structured import json_grammar

        grammar = json_grammar(schema, "bench")
        self.compiler.constraint(grammar)
        return grammar

    def fresh(self, compiled):
        return self.compiler.constraint(compiled)  # a cache hit

    def again(self, schema):
        """What a later request with the same schema costs: the cache lookup and a fresh matcher."""
        from service.answer.structured import json_grammar

        return self.compiler.constraint(json_grammar(schema, "bench"))

    def mask(self, matcher) -> torch.Tensor:
        return matcher.allowed()

    def accept(self, matcher, token: int) -> bool:
        return matcher.advance(token)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, eos: list[int]):
        import xgrammar

        self.xgr, self.vocab, self.eos = xgrammar, vocab, eos
        t0 = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self.setup_s = time.perf_counter() - t0
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        return self.compiler.compile_json_schema(_compact(schema), any_whitespace=False, separators=(", ", ": "))

    def fresh(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def again(self, schema):
        return self.xgr.GrammarMatcher(self.compile(schema))  # its compile cache hit, a fresh matcher

    def mask(self, matcher) -> torch.Tensor:
        matcher.fill_next_token_bitmask(self.bitmask)
        bits = self.bitmask.numpy().view(np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little", count=self.vocab).view(np.bool_))

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


def engines(tokenizer, vocab: int, eos: list[int]) -> list:
    found = [LLGuidance(tokenizer, vocab, eos)]
    try:
        found.append(XGrammar(tokenizer, vocab, eos))
    except ImportError:
        print("xgrammar is not installed: measuring llguidance only", file=sys.stderr)
    return found


def mask_times(engine, compiled, tokens: int, seed: int = 0) -> list[float]:
    """Seconds per mask while writing valid answers from random logits (the mask's work only); a new
    answer starts after each end of turn."""
    generator, times = torch.Generator().manual_seed(seed), []
    matcher = engine.fresh(compiled)
    for _ in range(tokens):
        t0 = time.perf_counter()
        allowed = engine.mask(matcher)
        times.append(time.perf_counter() - t0)
        logits = torch.randn(engine.vocab, generator=generator).masked_fill(~allowed, float("-inf"))
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        if not engine.accept(matcher, token) or token in engine.eos:
            matcher = engine.fresh(compiled)
    return times


def accepts(engine, tokenizer, compiled, instance) -> bool:
    """The whole instance is accepted token by token, and the grammar may end there."""
    matcher = engine.fresh(compiled)
    ids = tokenizer(_compact(instance), add_special_tokens=False)["input_ids"]
    return all(engine.accept(matcher, t) for t in ids) and bool(engine.mask(matcher)[engine.eos].any())


def outcome(engine, tokenizer, schema, valid, invalid) -> str:
    """enforced (valid accepted, invalid refused), refused (the schema: a 400 in the service), or
    ignored (it compiles, yet an answer breaking the keyword gets through, or a valid one does not)."""
    try:
        compiled = engine.compile(schema)
    except Exception:
        return "refused"
    good = accepts(engine, tokenizer, compiled, valid) and not accepts(engine, tokenizer, compiled, invalid)
    return "enforced" if good else "ignored"


def engine_rows(label: str, tokenizer, vocab: int, eos: list[int], tokens: int) -> tuple[list[list], dict]:
    """One row per grammar engine on `tokenizer`, and each engine's outcome per probed feature."""
    rows, outcomes = [], {}
    for engine in tqdm(engines(tokenizer, vocab, eos), desc=f"grammar engines, {label}", unit="engine"):
        t0 = time.perf_counter()
        compiled = engine.compile(RECEIPT)
        cold = time.perf_counter() - t0
        matcher = engine.fresh(compiled)
        t0 = time.perf_counter()
        engine.mask(matcher)
        first_mask = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.again(RECEIPT)
        again = time.perf_counter() - t0
        times = sorted(mask_times(engine, compiled, tokens))
        outcomes[engine.name] = {f: outcome(engine, tokenizer, *probe) for f, *probe in COVERAGE}
        enforced = sum(o == "enforced" for o in outcomes[engine.name].values())
        rows.append(
            [
                label,
                engine.name,
                f"{engine.setup_s * 1000:.0f}",
                f"{cold * 1000:.1f}",
                f"{first_mask * 1000:.2f}",
                f"{again * 1000:.2f}",
                f"{statistics.median(times) * 1000:.3f}",
                f"{times[int(len(times) * 0.99)] * 1000:.3f}",
                f"{enforced}/{len(COVERAGE)}",
            ]
        )
    return rows, outcomes


def installed_mb(*distributions: str) -> str:
    """Disk taken by installed distributions (their RECORD files' sizes), MB each."""
    from importlib.metadata import PackageNotFoundError, distribution

    sizes = []
    for name in distributions:
        try:
            files = distribution(name).files or []
        except PackageNotFoundError:
            continue
        sizes.append(f"{name} {sum(f.size or 0 for f in files) / 1e6:.1f} MB")
    return ", ".join(sizes)


def large_vocabulary_tokenizer(cache_dir: Path):
    """A byte-level BPE of Qwen's vocabulary size (151,643 + its special tokens), trained here (~15 s,
    once, cached) on the Python sources on this machine: the random checkpoints' own tokenizers learn
    only a few hundred tokens from their small corpus, and a mask's cost grows with the vocabulary."""
    from transformers import PreTrainedTokenizerFast

    from service.random_checkpoints.tokenizer import train_bpe

    path = cache_dir / "bench-bpe-151643" / "tokenizer.json"
    if not path.exists():
        sources = sorted(Path(torch.__file__).parents[2].rglob("*.py"))

        def texts(limit=80_000_000):
            read = 0
            for source in sources:
                if read > limit:
                    return
                text = source.read_text(encoding="utf-8", errors="replace")
                read += len(text)
                yield text

        tokenizer = train_bpe(texts(), 151_643)
        path.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>", pad_token="<|endoftext|>")


def compare_engines(engine, cache_dir: Path, tokens: int) -> str:
    tokenizer = engine.processor.tokenizer
    vocab, eos = engine.inputs.vocab_size, sorted(engine.inputs.grammars.eos_ids)
    rows, outcomes = engine_rows(
        f"this checkpoint's ({len(tokenizer)} tokens, logits over {vocab})", tokenizer, vocab, eos, tokens
    )
    big = large_vocabulary_tokenizer(cache_dir)
    big_eos = [big.convert_tokens_to_ids("<|im_end|>"), big.convert_tokens_to_ids("<|endoftext|>")]
    big_rows, _ = engine_rows(f"a {len(big):,}-token BPE (Qwen's size)", big, len(big), big_eos, tokens)
    table = markdown_table(
        [
            "tokenizer",
            "engine",
            "tokenizer setup ms",
            "receipt schema compile ms (cold)",
            "its first mask ms",
            "again (cached) ms",
            "mask ms/token (median)",
            "p99",
            "JSON-Schema features enforced",
        ],
        rows + big_rows,
    )
    features = markdown_table(
        ["feature", *outcomes], [[f, *(outcomes[name][f] for name in outcomes)] for f, *_ in COVERAGE]
    )
    return (
        f"{table}\n\nEach feature probed with a schema, a valid instance and an invalid one (this checkpoint's "
        "tokenizer): enforced = the valid one accepted token by token and the invalid one refused; refused = "
        "the schema does not compile (in the service: a 400); ignored = it compiles, yet the invalid one gets "
        f"through (or the valid one does not).\n\n{features}\n\nInstalled: "
        f"{installed_mb('llguidance')}; {installed_mb('xgrammar', 'triton', 'apache-tvm-ffi')}."
    )


# -- the service ------------------------------------------------------------------------------


class AcceptTimer:
    """Time in Sequence.accept (sampling, and for a constrained sequence its grammar's mask and
    advance), per token, split by whether the sequence has a grammar: the grammar's own cost,
    measured where it is paid — inside the batch's shared decode step."""

    def __init__(self):
        from service.engine.sequence import Sequence

        self.seconds = {True: [], False: []}
        original = Sequence.accept

        def timed(sequence, logits):
            t0 = time.perf_counter()
            token = original(sequence, logits)
            self.seconds[sequence.constraint is not None].append(time.perf_counter() - t0)
            return token

        Sequence.accept = timed

    def ms(self, constrained: bool) -> float:
        return statistics.median(self.seconds[constrained]) * 1000


def _streams(session: Session, grammars: list, tokens: int) -> tuple[float, list[float]]:
    """One request per entry of `grammars` (None = unconstrained), together: the run's wall time and
    each stream's decode tok/s. End of turn is biased away (-100), so each decodes all its tokens."""
    no_end = {token: -100.0 for token in session.engine.inputs.grammars.eos_ids}
    requests = [
        {
            "parts": [f"Write a long text about topic {i}."],
            "max_tokens": tokens,
            "temperature": 1.0,
            "seed": i,
            "logit_bias": no_end,
            "grammar": grammar,
        }
        for i, grammar in enumerate(grammars)
    ]
    done, wall = session.together(requests)
    for d in done:
        assert d.completion_tokens == tokens, (d.completion_tokens, d.finish_reason)
    return wall, [d.timings.decode_tokens_per_s for d in done]


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def measure_service(session: Session, tokens: int, repeats: int) -> str:
    from service.answer.structured import json_grammar

    constrained = json_grammar(LONG_TEXT, "response_format")
    _streams(session, [None], 8)  # warm-up
    _streams(session, [constrained], 8)
    timer = AcceptTimer()
    single = {"plain": [], "json": []}  # one stream's decode tok/s
    batch = {"plain": [], "json": []}  # a batch of 4's run, seconds (4 prefills, then the shared steps)
    with tqdm(total=repeats * 8, desc="decode runs", unit="run") as bar:
        for _ in range(repeats):
            for kind in ("plain", "json", "json", "plain"):  # ABBA: drift falls on both alike
                grammar = constrained if kind == "json" else None
                single[kind] += _streams(session, [grammar], tokens)[1]
                bar.update()
                batch[kind].append(_streams(session, [grammar, None, None, None], tokens)[0])
                bar.update()
    one_plain, one_json = (statistics.median(single[k]) for k in ("plain", "json"))
    four_plain, four_json = (statistics.median(batch[k]) for k in ("plain", "json"))
    plain_ms, grammar_ms = timer.ms(False), timer.ms(True)
    step_ms = 1000 / one_plain
    rows = [
        [
            "one stream: decode tok/s",
            _spread(single["plain"]),
            _spread(single["json"]),
            f"{(1 - one_json / one_plain) * 100:+.1f} %",
        ],
        [
            "batch of 4, one of them with the schema: seconds for the run",
            _spread(batch["plain"]),
            _spread(batch["json"]),
            f"{(four_json / four_plain - 1) * 100:+.1f} %",
        ],
        [
            "choosing a token (Sequence.accept), ms, median per token",
            f"{plain_ms:.3f}",
            f"{grammar_ms:.3f}",
            f"+{grammar_ms - plain_ms:.3f} ms = {(grammar_ms - plain_ms) / step_ms * 100:.2f} % "
            f"of a {step_ms:.0f} ms step",
        ],
    ]
    table = markdown_table(["", "no schema", "with a schema", "cost"], rows)
    return (
        f"{table}\n\nMedians (min–max) of {repeats * 2} runs per kind in ABBA order, {tokens} tokens per stream. "
        "The schema's per-token work is the difference in the last row; it is done inside the batch's shared "
        "step, so every stream of that batch waits for it, by the same fraction of a step (neighbours' tokens "
        "are unchanged: tests/test_structured.py)."
    )


def compile_times(engine) -> str:
    from service.answer.structured import OutputGrammar, json_grammar
    from service.answer.tools import call_rules

    weather = {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    }
    cases = [
        ("any JSON object (json_object)", json_grammar({"type": "object"}, "response_format")),
        ("receipt schema", json_grammar(RECEIPT, "response_format")),
        (
            "tool call (tool_choice: required, 2 tools)",
            OutputGrammar("start: calls\n" + call_rules([weather, {**weather, "name": "get_time"}], True), "tools"),
        ),
    ]
    t0 = time.perf_counter()
    engine.inputs.grammars.tokenizer()  # once per process, before the first grammar
    rows = [["(llguidance's tokenizer, built once per process)", f"{(time.perf_counter() - t0) * 1000:.1f}", "0"]]
    for name, grammar in cases:
        t0 = time.perf_counter()
        engine.inputs.grammars.constraint(grammar)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.inputs.grammars.constraint(grammar)
        rows.append([name, f"{cold * 1000:.1f}", f"{(time.perf_counter() - t0) * 1000:.2f}"])
    return markdown_table(["grammar", "first request: compile ms", "next requests (cached) ms"], rows)


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per stream")
    p.add_argument("--repeats", type=int, default=2, help="ABBA rounds")
    args = parse(p, argv)
    torch.set_num_threads(args.threads)
    session = Session(
        args.model_path,
        args.threads,
        quantization=args.quantization,
        max_batch_size=4,
        max_new_tokens=max(args.tokens, 64),
    )
    logging.getLogger("service.answer.structured").setLevel(logging.CRITICAL)  # the probes' refused tokens are expected
    engines_table = compare_engines(session.engine, session.settings.cache_dir, 400)
    compile_table = compile_times(session.engine)
    service_table = measure_service(session, args.tokens, args.repeats)
    body = (
        "Grammar engines, on one thread (the scheduler's), masks computed while writing valid receipt JSON from "
        "random logits (400 tokens); llguidance through the service's own GrammarCompiler and Constraint:\n\n"
        f"{engines_table}\n\nThe service's compile cache (GrammarCompiler, a fresh one):\n\n{compile_table}\n\n"
        f"Decoding with and without a schema, temperature 1; the constrained stream writes a JSON string of at "
        f"least 2000 characters:\n\n{service_table}"
    )
    return report(
        args,
        "Structured outputs: the cost of a JSON-Schema constraint",
        {
            "MODEL_PATH": args.model_path.name,
            "QUANTIZATION": args.quantization,
            "THREADS": args.threads,
            "MAX_BATCH_SIZE": 4,
            "llguidance": _version("llguidance"),
            "xgrammar": _version("xgrammar"),
        },
        body,
        save=not (args.no_save or args.tiny),  # a --tiny run is a check, not a figure
    )


if __name__ == "__main__":
    sys.exit(main())
