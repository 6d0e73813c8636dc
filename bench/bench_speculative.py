"""Exact speculative decoding: decode tokens/s with it on and off, in one run, and the same answers.

    flock /tmp/heavy.lock python -m bench.bench_speculative [--rounds 1]

One process, one loaded model (the pre-quantized 2B-shaped checkpoint, 2 threads, caches off), two
engines on it: SPECULATIVE=on and off, their requests alternating (A B B A per round). Decode
tokens/s is the engine's own (`decode_tokens_per_s`), greedy, end of turn biased away:
- JSON-Schema answers (bench_structured's receipt schema) and a forced tool call: the guesses are the
  grammar's forced tokens;
- the ceiling: guesses always right (the answer of an earlier identical run, fed as the guess) at
  k = 2, 4 and 8 guesses per step — random weights never copy their prompt, so this stands in for
  answers that copy (extraction, reformatting, edits);
- the floor: guesses always wrong (tokens the answer never holds), given to each sequence's own budget
  (which shrinks and pauses them), and forced into every step (the raw cost of verifying them);
- a batch of 4 concurrent streams (aggregate tokens/s, their own guesses).
Every pair of answers is compared: the same token ids with speculation on and off.
"""

from __future__ import annotations

import statistics

from tqdm import tqdm

from bench.core.harness import parse, parser
from bench.core.inputs import DECODE_PROMPT as PROSE
from bench.core.inputs import RECEIPT
from bench.core.results import markdown_table, report
from bench.core.session import Session

TOKENS = 128
FLOOR = "floor: wrong guesses, the budget adapting"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=1, help="of A B B A (each: 2 requests per mode)")
    args = parse(p, argv)
    model_path = args.model_path

    import torch

    from service.answer.structured import OutputGrammar, json_grammar
    from service.answer.tools import call_rules
    from service.engine import drafts as drafts_module

    on = Session(model_path, args.threads, speculative="on", speculative_tokens=8)
    engines = {"on": on, "off": on.variant(speculative="off")}
    no_end = on.no_end_of_turn()
    torch.set_num_threads(args.threads)

    def ask(session, text, grammar=None, tools=None):
        return session.ask(text, max_tokens=TOKENS, logit_bias=no_end, grammar=grammar, tools=tools)

    real_drafts, real_lookup = drafts_module.DraftBudget.drafts, drafts_module.prompt_lookup
    oracle = {}

    first_wrong = min(4000, on.engine.inputs.vocab_size // 2)  # (the embedded model's vocabulary is small)

    def wrong(k: int) -> list[int]:
        return [t for t in range(first_wrong, first_wrong + 2 * k) if t not in oracle["answer"]][:k]

    def with_guesses(kind: str, k: int):
        """Patch every sequence's guesses: the earlier answer's next k tokens every step (right), tokens
        it never holds every step (wrong), or wrong ones as prompt lookup's, so the sequence's own
        budget adapts to them (wrong, adapting); "own": the sequences' own."""
        drafts_module.DraftBudget.drafts, drafts_module.prompt_lookup = real_drafts, real_lookup
        if kind == "own":
            return
        if kind == "wrong, adapting":
            drafts_module.prompt_lookup = lambda token_ids, count: wrong(count)
            return
        answer, prompt_length = oracle["answer"], oracle["prompt"]

        def guesses(self, token_ids, constraint, room):
            made = len(token_ids) - prompt_length
            if kind == "right":
                return list(answer[made : made + min(k, room)]), True
            return wrong(min(k, room)), True

        drafts_module.DraftBudget.drafts = guesses

    receipt = json_grammar(RECEIPT, "bench")
    # tool_choice "required", one call: the grammar the service enforces, the tool its prompt shows
    tool_call = OutputGrammar("start: calls\n" + call_rules([WEATHER["function"]], parallel=False), "tools")
    cases = [
        ("JSON Schema (receipt)", "own", 8, dict(text="Read the receipt in this message.", grammar=receipt)),
        (
            "tool call (required)",
            "own",
            8,
            dict(text="Weather in Bern?", grammar=tool_call, tools=[WEATHER]),
        ),
        ("ceiling: right guesses, k = 2", "right", 2, dict(text=PROSE)),
        ("ceiling: right guesses, k = 4", "right", 4, dict(text=PROSE)),
        ("ceiling: right guesses, k = 8", "right", 8, dict(text=PROSE)),
        (FLOOR, "wrong, adapting", 8, dict(text=PROSE)),
        ("floor without adapting: 4 wrong guesses every step", "wrong", 4, dict(text=PROSE)),
        ("prose, its own guesses (prompt lookup)", "own", 8, dict(text=PROSE)),
    ]
    with_guesses("own", 0)
    reference = ask(engines["off"], PROSE)
    oracle["answer"] = list(reference.token_ids)
    oracle["prompt"] = reference.prompt_tokens
    rows, targets = [], {}
    for label, kind, k, request in tqdm(cases, desc="cases"):
        runs = {"on": [], "off": []}
        for _ in range(args.rounds):
            for mode in ("on", "off", "off", "on"):
                with_guesses(kind if mode == "on" else "own", k)
                runs[mode].append(ask(engines[mode], **request))
        with_guesses("own", 0)
        rate = {m: statistics.median(d.timings.decode_tokens_per_s for d in runs[m]) for m in runs}
        same = len({d.token_ids for d in runs["on"] + runs["off"]}) == 1
        done = runs["on"][0]
        ratio = rate["on"] / rate["off"]
        targets[label] = ratio
        rows.append(
            [
                label,
                done.completion_tokens,
                f"{done.accepted_tokens}/{done.drafted_tokens}",
                rate["off"],
                rate["on"],
                f"{ratio:.2f}x",
                "yes" if same else "NO",
            ]
        )

    # a batch of 4 streams, their own guesses
    def streams(session) -> float:
        texts = [f"Repeat after me, twice: red square, blue circle, yellow triangle ({i})." for i in range(4)]
        done, wall = session.together([{"parts": [t], "max_tokens": TOKENS, "logit_bias": no_end} for t in texts])
        return sum(d.completion_tokens for d in done) / wall

    batch = {"on": [], "off": []}
    for mode in ("on", "off", "off", "on"):
        batch[mode].append(streams(engines[mode]))
    b_on, b_off = statistics.median(batch["on"]), statistics.median(batch["off"])
    rows.append(["batch of 4, their own guesses (aggregate)", 4 * TOKENS, "", b_off, b_on, f"{b_on / b_off:.2f}x", ""])
    json_ratio = min(targets["JSON Schema (receipt)"], targets["tool call (required)"])
    body = markdown_table(
        ["answer", "tokens", "guesses made / guessed", "off (tok/s)", "on (tok/s)", "on / off", "same answer"], rows
    ) + (
        f"\n\nMedians of {2 * args.rounds} requests per mode (A B B A), decode tokens/s as the engine counts it. "
        "Random weights never copy their prompt: the ceiling's guesses (the answer of an earlier identical run) "
        "stand in for answers that copy. Targets: JSON-Schema answers >= 1.5x: "
        f"{json_ratio:.2f} ({'met' if json_ratio >= 1.5 else 'missed'}); ceiling (k = 4) >= 2.5x: "
        f"{targets['ceiling: right guesses, k = 4']:.2f} "
        f"({'met' if targets['ceiling: right guesses, k = 4'] >= 2.5 else 'missed'}); floor >= 0.97x: "
        f"{targets[FLOOR]:.2f} ({'met' if targets[FLOOR] >= 0.97 else 'missed'}). The floor is the product's: "
        "every guess wrong, each sequence's own budget shrinking and pausing its guesses; the row after it "
        "forces 4 wrong guesses into every step, the cost of verifying them without that budget."
    )
    return report(
        args,
        "Exact speculative decoding: on against off",
        {
            "MODEL_PATH": model_path.name,
            "THREADS": args.threads,
            "caches": "off",
            "tokens": TOKENS,
            "SPECULATIVE_TOKENS": 8,
        },
        body,
        speculation="on and off, each figure's row says which (the scenario's own engines: --speculative has no say)",
    )


if __name__ == "__main__":
    raise SystemExit(main())
