"""What a JSON-Schema constraint costs: grammar engines compared on this CPU (per-token mask, compile
time, JSON-Schema coverage), then the service's decode speed with and without a schema, alone and
in a batch of 4 where one stream is constrained.

    flock /tmp/heavy.lock python -m bench.bench_structured      # 2B-shaped INT8 checkpoint
    python -m bench.bench_structured --tiny --no-save           # quick run on the embedded model

xgrammar is measured only if installed (`pip install xgrammar`: it pulls triton, ~1 GB); the
service uses llguidance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import add_checkpoint_args, checkpoint_of  # noqa: E402
from bench.results import append_section, markdown_table  # noqa: E402

# An extraction schema of the kind users send: nested objects, arrays, enums, numbers, a pattern.
RECEIPT = {
    "type": "object",
    "properties": {
        "shop": {"type": "string", "maxLength": 40},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "currency": {"enum": ["EUR", "USD", "CHF", "GBP"]},
        "items": {
            "type": "array",
            "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "maxLength": 30},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["label", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "total": {"type": "number"},
        "paid_by_card": {"type": "boolean"},
    },
    "required": ["shop", "date", "currency", "items", "total", "paid_by_card"],
    "additionalProperties": False,
}
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
    ("number bounds, multipleOf", {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}, 7.5, 7.25),
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
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, eos: list[int]):
        import llguidance
        import llguidance.hf

        from service.structured import JSON_STYLE

        self.llg, self.style, self.vocab, self.eos = llguidance, JSON_STYLE, vocab, eos
        t0 = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
        self.setup_s = time.perf_counter() - t0

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=self.style)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fresh(self, compiled):
        return compiled.deep_copy()

    def mask(self, matcher) -> torch.Tensor:
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little", count=self.vocab).view(np.bool_))

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, eos: list[int]):
        import xgrammar

        self.xgr, self.vocab, self.eos = xgrammar, vocab, eos
        t0 = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=True)
        self.setup_s = time.perf_counter() - t0
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        return self.compiler.compile_json_schema(_compact(schema), any_whitespace=False, separators=(", ", ": "))

    def fresh(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, matcher) -> torch.Tensor:
        matcher.fill_next_token_bitmask(self.bitmask)
        bits = self.bitmask.numpy().view(np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little", count=self.vocab).view(np.bool_))

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


def engines(tokenizer, vocab: int, eos: list[int]) -> list:
    found = [LLGuidance(tokenizer, vocab, eos)]
    try:
        found.append(XGrammar(tokenizer, vocab, eos))
    except ImportError:
        print("xgrammar is not installed: measuring llguidance only", file=sys.stderr)
    return found


def mask_times(engine, compiled, tokens: int, seed: int = 0) -> list[float]:
    """Seconds per mask while writing a valid answer from random logits (the mask's work only)."""
    generator, times = torch.Generator().manual_seed(seed), []
    matcher = engine.fresh(compiled)
    for _ in range(tokens):
        t0 = time.perf_counter()
        allowed = engine.mask(matcher)
        times.append(time.perf_counter() - t0)
        logits = torch.randn(engine.vocab, generator=generator).masked_fill(~allowed, float("-inf"))
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        if not engine.accept(matcher, token) or engine.done(matcher):
            matcher = engine.fresh(compiled)
    return times


def accepts(engine, tokenizer, compiled, instance) -> bool:
    """The whole instance is accepted token by token, and the grammar may end there."""
    matcher = engine.fresh(compiled)
    ids = tokenizer(_compact(instance), add_special_tokens=False)["input_ids"]
    return all(engine.accept(matcher, t) for t in ids) and bool(engine.mask(matcher)[engine.eos].any())


def enforced(engine, tokenizer, schema, valid, invalid) -> bool:
    try:
        compiled = engine.compile(schema)
    except Exception:
        return False  # refused: a 400 in the service, never an unchecked answer
    return accepts(engine, tokenizer, compiled, valid) and not accepts(engine, tokenizer, compiled, invalid)


def engine_rows(label: str, tokenizer, vocab: int, eos: list[int], tokens: int) -> tuple[list[list], dict]:
    """One row per grammar engine on `tokenizer`, and the features each does not enforce."""
    rows, missing = [], {}
    for engine in tqdm(engines(tokenizer, vocab, eos), desc=f"grammar engines, {label}", unit="engine"):
        t0 = time.perf_counter()
        compiled = engine.compile(RECEIPT)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.fresh(engine.compile(RECEIPT) if engine.name == "xgrammar" else compiled)
        cached = time.perf_counter() - t0
        times = sorted(mask_times(engine, compiled, tokens))
        missing[engine.name] = [f for f, *probe in COVERAGE if not enforced(engine, tokenizer, *probe)]
        rows.append(
            [
                label,
                engine.name,
                f"{engine.setup_s * 1000:.0f}",
                f"{cold * 1000:.1f}",
                f"{cached * 1000:.2f}",
                f"{statistics.median(times) * 1000:.3f}",
                f"{times[int(len(times) * 0.99)] * 1000:.3f}",
                f"{len(COVERAGE) - len(missing[engine.name])}/{len(COVERAGE)}",
            ]
        )
    return rows, missing


def large_vocabulary_tokenizer(cache_dir: Path):
    """A byte-level BPE of Qwen's vocabulary size (151,643 + its special tokens), trained here (~15 s,
    once, cached) on the Python sources on this machine: the random checkpoints' own tokenizers learn
    only a few hundred tokens from their small corpus, and a mask's cost grows with the vocabulary."""
    from transformers import PreTrainedTokenizerFast

    from service.checkpoints import train_bpe

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
    vocab, eos = engine.grammars.vocab_size, sorted(engine.grammars.eos_ids)
    rows, missing = engine_rows(
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
            "again (cached) ms",
            "mask ms/token (median)",
            "p99",
            "JSON-Schema features enforced",
        ],
        rows + big_rows,
    )
    gaps = "; ".join(f"{name} does not enforce: {', '.join(m) or 'none'}" for name, m in missing.items())
    return (
        table
        + "\n\nFeatures probed (each: the schema compiles, a valid instance is accepted and an invalid one refused): "
        + f"{', '.join(f for f, *_ in COVERAGE)}. {gaps}. An engine that cannot compile a keyword refuses the "
        + "schema (the service: a 400); one that ignores it accepts the invalid instance."
    )


# -- the service ------------------------------------------------------------------------------


def _streams(engine, grammars: list, tokens: int) -> list[float]:
    """Run one request per entry of `grammars` (None = unconstrained) together; each one's decode tok/s."""
    from service.generation import GenerationRequest, SamplingParams
    from service.prompts import ChatMessage, TextPart

    results: list[float] = [0.0] * len(grammars)

    def run(i, grammar):
        request = GenerationRequest(
            [ChatMessage("user", [TextPart(f"Write a long text about topic {i}.")])],
            SamplingParams(max_tokens=tokens, temperature=1.0, seed=i),
            grammar=grammar,
        )
        *_, done = engine.generate(request)
        assert done.completion_tokens == tokens, (done.completion_tokens, done.finish_reason)
        results[i] = done.timings.decode_tokens_per_s

    threads = [threading.Thread(target=run, args=(i, g)) for i, g in enumerate(grammars)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def measure_service(engine, tokens: int, repeats: int) -> tuple[str, dict]:
    from service.structured import json_grammar

    constrained = json_grammar(LONG_TEXT, "response_format")
    _streams(engine, [None], 8)  # warm-up
    _streams(engine, [constrained], 8)
    single = {"plain": [], "json": []}
    first = {"plain": [], "json": []}  # the batch's first stream: constrained in the "json" runs
    neighbours = {"plain": [], "json": []}  # the mean of the other three, never constrained
    with tqdm(total=repeats * 8, desc="decode runs", unit="run") as bar:
        for _ in range(repeats):
            for kind in ("plain", "json", "json", "plain"):  # ABBA: drift falls on both alike
                grammar = constrained if kind == "json" else None
                single[kind] += _streams(engine, [grammar], tokens)
                bar.update()
                rates = _streams(engine, [grammar, None, None, None], tokens)
                first[kind].append(rates[0])
                neighbours[kind].append(statistics.mean(rates[1:]))
                bar.update()
    one_plain, one_json = statistics.median(single["plain"]), statistics.median(single["json"])
    nb_plain, nb_json = statistics.median(neighbours["plain"]), statistics.median(neighbours["json"])
    first_plain, constrained_rate = statistics.median(first["plain"]), statistics.median(first["json"])
    rows = [
        ["one stream", f"{one_plain:.2f}", f"{one_json:.2f}", f"{(1 - one_json / one_plain) * 100:+.1f} %"],
        [
            "batch of 4: the stream with the schema",
            f"{first_plain:.2f}",
            f"{constrained_rate:.2f}",
            f"{(1 - constrained_rate / first_plain) * 100:+.1f} %",
        ],
        [
            "batch of 4: its 3 unconstrained neighbours (mean)",
            f"{nb_plain:.2f}",
            f"{nb_json:.2f}",
            f"{(1 - nb_json / nb_plain) * 100:+.1f} %",
        ],
    ]
    table = markdown_table(["decode", "no schema tok/s", "with a schema tok/s", "cost"], rows)
    return table, {"one": (one_plain, one_json), "neighbours": (nb_plain, nb_json)}


def compile_times(engine) -> str:
    from service.structured import OutputGrammar, json_grammar
    from service.tools import call_rules

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
    rows = []
    for name, grammar in cases:
        t0 = time.perf_counter()
        engine.grammars.constraint(grammar)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.grammars.constraint(grammar)
        rows.append([name, f"{cold * 1000:.1f}", f"{(time.perf_counter() - t0) * 1000:.2f}"])
    return markdown_table(["grammar", "first request: compile ms", "next requests (cached) ms"], rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(p)
    p.add_argument("--tiny", action="store_true", help="the embedded tiny model (a quick check, not a figure)")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per stream")
    p.add_argument("--repeats", type=int, default=2, help="ABBA rounds")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from service.checkpoints import embedded_model_dir
    from service.engine import Engine
    from service.loading import load_model
    from service.settings import load_settings

    if args.tiny:
        model_path = embedded_model_dir(load_settings().cache_dir)
    else:
        model_path = checkpoint_of(args)
    settings = load_settings(
        model_path=model_path,
        quantization=args.quantization,
        threads=args.threads,
        cache_enabled=False,
        max_batch_size=4,
        max_new_tokens=max(args.tokens, 64),
    )
    engine = Engine(load_model(settings), settings)
    engines_table = compare_engines(engine, settings.cache_dir, 400)
    compile_table = compile_times(engine)
    service_table, _ = measure_service(engine, args.tokens, args.repeats)
    body = (
        "Grammar engines, on one thread (the scheduler's), masks computed while writing valid receipt JSON from "
        "random logits (400 tokens):\n\n"
        f"{engines_table}\n\nThe service's compile cache (GrammarCompiler; the first grammar of a process also "
        f"builds llguidance's tokenizer):\n\n{compile_table}\n\nDecode speed, `timings.decode_tokens_per_s` of "
        f"each stream, {args.tokens} tokens per stream, temperature 1, median of {args.repeats * 2} runs per kind "
        f"in ABBA order; the constrained stream writes a JSON string of at least 2000 characters (so every "
        f"stream decodes all its tokens):\n\n{service_table}"
    )
    print(body)
    if not args.no_save and not args.tiny:
        append_section(
            "Structured outputs: the cost of a JSON-Schema constraint (bench/bench_structured.py)",
            {
                "MODEL_PATH": model_path.name,
                "QUANTIZATION": args.quantization,
                "THREADS": args.threads,
                "MAX_BATCH_SIZE": 4,
            },
            body,
            threads=args.threads,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
