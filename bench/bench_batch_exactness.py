"""How far a sequence's logits in a decode batch are from its logits alone, fp32 and INT8.

    flock /tmp/heavy.lock python -m bench.bench_batch_exactness [--tiny | --model-path DIR] [--steps 32]

Each of 4 prompts (different lengths) is prefilled alone and decoded greedily alone; then the same
tokens are fed again as a batch of 1, 2 and 4 through the engine's forward (service/model/forward.py:
each sequence its own KV cache and M-RoPE position) — teacher-forced, so a divergence at one step
does not compound. Per batch size: the largest |Δlogit| over all steps and
sequences, and the share of steps whose greedy token differs from the alone one. INT8 is measured
as shipped (activations quantized per token) and with per-tensor activations (one scale for the
whole batch, torch's dynamic quantization, what the service did before), on the same weights.
"""

from __future__ import annotations

import torch
from tqdm import tqdm
from transformers import DynamicCache

from bench.core.harness import parse, parser
from bench.core.results import markdown_table, report

PROMPTS = [
    "Hi.",
    "Tell me a long story about a red square and a blue circle on a table, please.",
    "What is the capital of a small country?",
    "Count from one to twenty, slowly, with a word for each.",
]


def prefill(model, ids: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    cache = DynamicCache(config=model.config)
    positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
    out = model(input_ids=ids, position_ids=positions, cache=cache, logits_to_keep=1)
    return cache, out.logits[:, -1].float()


def copy(cache: DynamicCache, config) -> DynamicCache:
    return DynamicCache(
        ddp_cache_data=[(layer.keys.clone(), layer.values.clone()) for layer in cache.layers], config=config
    )


def decode(model, caches: list[DynamicCache], lengths: list[int], fed: list[list[int]]) -> list[list[torch.Tensor]]:
    """Feed fed[i][step] to sequence i at each step, all together through the engine's forward
    (service/model/forward.py); logits per sequence and step."""
    from service.model.attention import ExactAttention
    from service.model.forward import Rows, TextForward

    step_fn = TextForward(model, ExactAttention.load())
    logits = [[] for _ in caches]
    for step in range(len(fed[0])):
        positions = torch.tensor([n + step for n in lengths])
        out = step_fn(torch.tensor([f[step] for f in fed]), positions, [Rows(c, 1) for c in caches])
        for i in range(len(caches)):
            logits[i].append(out[i].float())
    return logits


def measure(model, tokenizer, steps: int) -> list[list]:
    ids = [tokenizer(p, return_tensors="pt")["input_ids"] for p in PROMPTS]
    prefilled = [prefill(model, i) for i in ids]
    lengths = [i.shape[1] for i in ids]
    # Alone: greedy tokens and their logits.
    alone_tokens, alone_logits = [], []
    for (cache, first), n in zip(prefilled, lengths):
        tokens, logits = [int(first.argmax())], []
        cache = copy(cache, model.config)  # the batched runs start from the prefill again
        for step in range(steps):
            row = decode(model, [cache], [n + step], [[tokens[-1]]])[0][0]
            logits.append(row)
            tokens.append(int(row.argmax()))
        alone_tokens.append(tokens)
        alone_logits.append(logits)
    rows = []
    for size in (1, 2, 4):
        fed = [alone_tokens[i][:steps] for i in range(size)]
        batched = decode(model, [copy(c, model.config) for c, _ in prefilled[:size]], lengths[:size], fed)
        delta = max(float((b - a).abs().max()) for i in range(size) for a, b in zip(alone_logits[i], batched[i]))
        flips = sum(int(b.argmax()) != alone_tokens[i][s + 1] for i in range(size) for s, b in enumerate(batched[i]))
        rows.append([size, f"{delta:.3g}", f"{flips}/{size * steps}"])
    return rows


VARIANTS = {
    "fp32": ("fp32", None),
    "int8 per-token (shipped)": ("int8", "per_token"),
    "int8 per-tensor (before)": ("int8", "per_tensor"),
}


def main(argv=None) -> None:
    p = parser(__doc__, quantization=False)
    p.add_argument("--steps", type=int, default=32)
    args = parse(p, argv, source=True)
    from service.model.loading import load_model
    from service.quant.int8_linear import set_activations
    from service.settings import load_settings

    table_rows, loaded = [], {}
    for label, (quantization, activations) in tqdm(VARIANTS.items(), desc="variants"):
        if quantization not in loaded:
            loaded.clear()  # one model in memory at a time
            # FBGEMM: the per-tensor rows switch its activations (the kernels give the same bits per token)
            settings = load_settings(
                model_path=args.model_path, quantization=quantization, threads=args.threads, int8_kernel="fbgemm"
            )
            loaded[quantization] = load_model(settings)
        model = loaded[quantization].model
        if activations:
            set_activations(model, activations)  # the same packed weights, the other activation scaling
        with torch.inference_mode():
            for row in measure(model, loaded[quantization].processor.tokenizer, args.steps):
                table_rows.append([label, *row])
    body = markdown_table(
        ["weights", "batch size", "largest abs Δlogit vs alone", "greedy tokens that differ"], table_rows
    )
    name = "embedded tiny" if args.tiny else args.model_path.name
    report(
        args,
        f"Batching: logits in a decode batch vs alone, {name}",
        {"model": name, "steps": args.steps, "prompts": len(PROMPTS)},
        body,
    )


if __name__ == "__main__":
    main()
