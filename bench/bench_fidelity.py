"""INT8 and 4-bit versus fp32 fidelity on a fixed prompt set: logit cosine similarity and greedy-token
agreement, for per-token activations (shipped; with fp32 and with bf16 keys and values), per-tensor
ones (torch's dynamic Linear, before), and 4-bit checkpoints (`quantize --bits 4`: the default with
the vision tower INT8, and everything 4-bit), without and with activation spikes.

The fp32 model answers each prompt greedily (`reference`, one process); each INT8 variant (its own
process, `compare`) then reads the same token sequences (teacher forcing) — logit cosine and top-1
agreement at every answer position — and also answers freely, compared token by token.
In the "spikes" scenario a forward hook multiplies the first token's MLP down-projection input by
SPIKE in an early and a late decoder layer, in fp32 and INT8 alike (real checkpoints of this family
carry such massive activations on the first token and on delimiters; random weights do not).

    flock /tmp/heavy.lock python -m bench.bench_fidelity     # CACHE_DIR/qwen3vl-2b-random (or --model-path)
    python -m bench.bench_fidelity --fidelity-bits int4 --fidelity-tokens 64   # the 4-bit rows
    python -m bench.bench_fidelity --tiny --no-save          # the embedded model: a quick check

The source's quantized copies (INT8: --int8-path, else <model-path>-int8; 4-bit: <model-path>-int4,
-int4-all) are written if missing, the INT8 one measured as bench_quantize does.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from bench.core import int8_suite
from bench.core.harness import isolated
from bench.core.inputs import encoded_photo
from bench.core.results import markdown_table
from bench.core.session import Session, growing_cache

TEXT_PROMPTS = [
    "What is the capital of France? Answer in one word.",
    "Tell me a story about a red square that travels across a blue sky.",
    "List three colors, then three shapes.",
    "Explain why the sky is blue to a child.",
]
IMAGE_PROMPTS = ["Describe this picture.", "How many circles are in this image, and what colors are they?"]

SHIPPED = "int8 per-token activations, bf16 KV cache (shipped: KV_DTYPE=bfloat16)"
VARIANTS = {  # label → (checkpoint, activations (INT8 only), keys and values as cached)
    "int8 per-token activations, fp32 KV cache (KV_DTYPE=float32)": ("int8", "per_token", "float32"),
    SHIPPED: ("int8", "per_token", "bfloat16"),
    "int8 per-tensor activations (before)": ("int8", "per_tensor", "float32"),
    "4-bit, groups of 128, vision tower INT8 (`quantize --bits 4`), bf16 KV": ("int4", None, "bfloat16"),
    "4-bit everywhere (`--keep-8bit none`: vision tower too), bf16 KV": ("int4-all", None, "bfloat16"),
}
CHECKPOINTS = {  # checkpoint → `write_quantized` arguments (besides source and destination)
    "int8": {},
    "int4": {"bits": 4},
    "int4-all": {"bits": 4, "keep_8bit": ()},
}
SCENARIOS = ("no spikes", "spikes")


def select(bits: str) -> dict:
    """The VARIANTS of `bits`: all, int8, or int4 (beside the shipped INT8 variant)."""
    return {
        label: v
        for label, v in VARIANTS.items()
        if bits == "all" or v[0].startswith(bits) or (bits == "int4" and label == SHIPPED)
    }


SPIKE = 1000.0


def spike_first_token(model):
    """Hooks (removable handles) that multiply token 0's MLP down-projection input by SPIKE in
    decoder layers 1 and L-2, in any forward that holds token 0 (the prompt's, not decode steps)."""
    layers = model.model.language_model.layers

    def hook(module, args):
        x = args[0]
        if x.shape[-2] < 2:  # a decode step: token 0 is not in it
            return None
        x = x.clone()
        x[..., 0, :] *= SPIKE
        return (x,)

    return [layers[i].mlp.down_proj.register_forward_pre_hook(hook) for i in (1, len(layers) - 2)]


def _inputs(engine, index: int) -> dict:
    """generate/forward kwargs for prompt `index` (image prompts get a 1080p photo at the pixel budget)."""
    import torch

    from service.media.images import decode_image
    from service.model.prompts import ChatMessage, ImagePart, TextPart, prepare_prompt

    if index < len(TEXT_PROMPTS):
        parts = [TextPart(TEXT_PROMPTS[index])]
    else:
        image = decode_image(encoded_photo(".jpg"), engine.limits.image)
        parts = [ImagePart(image), TextPart(IMAGE_PROMPTS[index - len(TEXT_PROMPTS)])]
    prompt = prepare_prompt(engine.processor, [ChatMessage("user", parts)], engine.limits.prompt)
    kwargs = dict(input_ids=prompt.input_ids, mm_token_type_ids=prompt.mm_token_type_ids)
    if prompt.pixel_values:
        kwargs.update(pixel_values=torch.cat(prompt.pixel_values), image_grid_thw=prompt.image_grid_thw)
    return kwargs


def _extended(kwargs: dict, sequence) -> dict:
    """The prompt's kwargs with the ids replaced by prompt + answer (answer tokens are text)."""
    import torch

    pad = sequence.shape[1] - kwargs["input_ids"].shape[1]
    types = torch.cat([kwargs["mm_token_type_ids"], torch.zeros(1, pad, dtype=kwargs["mm_token_type_ids"].dtype)], 1)
    return {**kwargs, "input_ids": sequence, "mm_token_type_ids": types}


def _cache(model, kv_dtype: str):
    """The KV cache the engine would use: keys and values stored (and attended to) in `kv_dtype`."""
    import torch

    return growing_cache(model.config, getattr(torch, kv_dtype))


def _answer_logits(model, kwargs: dict, sequence, prompt_len: int, kv_dtype: str = "float32"):
    import torch

    model.model.rope_deltas = None
    with torch.inference_mode():
        logits = model(**_extended(kwargs, sequence), cache=_cache(model, kv_dtype)).logits[0]
    return logits[prompt_len - 1 : -1].float()


def _greedy(model, kwargs: dict, tokens: int, kv_dtype: str = "float32"):
    import torch

    model.model.rope_deltas = None
    with torch.inference_mode():
        return model.generate(
            **kwargs,
            attention_mask=torch.ones_like(kwargs["input_ids"]),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            cache=_cache(model, kv_dtype),
        )


def _engine(model_path: str, threads: int, quantization: str, activations: str | None, spikes: bool):
    # per-tensor activations: torch's kernels only
    session = Session(
        model_path, threads, quantization=quantization, **({"int8_kernel": "fbgemm"} if activations else {})
    )
    if activations:
        from service.quant.int8_linear import set_activations

        set_activations(session.model, activations)
    if spikes:
        spike_first_token(session.model)
    return session.engine


def reference(model_path: str, threads: int, tokens: int, out_file: str, spikes: bool) -> dict:
    """fp32: greedy answers and their logits for every prompt, saved to `out_file`."""
    import torch

    engine = _engine(model_path, threads, "fp32", None, spikes)
    saved = []
    for i in range(len(TEXT_PROMPTS) + len(IMAGE_PROMPTS)):
        kwargs = _inputs(engine, i)
        sequence = _greedy(engine.model, kwargs, tokens)
        prompt_len = kwargs["input_ids"].shape[1]
        saved.append(
            {
                "sequence": sequence,
                "prompt_len": prompt_len,
                "logits": _answer_logits(engine.model, kwargs, sequence, prompt_len),
            }
        )
    torch.save(saved, out_file)
    return {"prompts": len(saved)}


def compare(
    model_path: str,
    threads: int,
    tokens: int,
    ref_file: str,
    activations: str | None,
    spikes: bool,
    kv_dtype: str = "float32",
) -> dict:
    """One variant (a pre-quantized checkpoint) against the saved fp32 reference."""
    import torch

    engine = _engine(model_path, threads, "int8", activations, spikes)
    cosines, top1, free_same, free_prefix = [], [], [], []
    for i, ref in enumerate(torch.load(ref_file)):
        kwargs = _inputs(engine, i)
        logits = _answer_logits(engine.model, kwargs, ref["sequence"], ref["prompt_len"], kv_dtype)
        cosines.append(torch.nn.functional.cosine_similarity(logits, ref["logits"], dim=-1))
        top1.append((logits.argmax(-1) == ref["logits"].argmax(-1)).float())
        answer = _greedy(engine.model, kwargs, tokens, kv_dtype)[0, ref["prompt_len"] :]
        expected = ref["sequence"][0, ref["prompt_len"] :]
        same = (answer == expected).tolist()
        free_same.append(sum(same) / len(same))
        free_prefix.append(same.index(False) if False in same else len(same))
    cos = torch.cat(cosines)
    return {
        "cosine_mean": float(cos.mean()),
        "cosine_min": float(cos.min()),
        "top1_agreement": float(torch.cat(top1).mean()),
        "greedy_agreement": sum(free_same) / len(free_same),
        "greedy_identical_answers": sum(p == tokens for p in free_prefix),
        "prompts": len(free_prefix),
        "mean_tokens_before_divergence": sum(free_prefix) / len(free_prefix),
    }


def run(source, checkpoints: dict, threads: int, tokens: int, variants: dict = VARIANTS) -> str:
    """`variants` against fp32 on checkpoint `source` (its quantized copies: `checkpoints`, by
    CHECKPOINTS key), in both scenarios: a markdown table."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        steps = tqdm(total=len(SCENARIOS) * (1 + len(variants)), desc=f"fidelity {Path(source).name}", unit="process")
        for scenario in SCENARIOS:
            spikes = scenario == "spikes"
            ref = str(Path(tmp) / f"fp32-{spikes}.pt")
            isolated(
                "bench.bench_fidelity:reference",
                model_path=str(source),
                threads=threads,
                tokens=tokens,
                out_file=ref,
                spikes=spikes,
            )
            steps.update()
            for label, (checkpoint, activations, kv_dtype) in variants.items():
                r = isolated(
                    "bench.bench_fidelity:compare",
                    model_path=str(checkpoints[checkpoint]),
                    threads=threads,
                    tokens=tokens,
                    ref_file=ref,
                    activations=activations,
                    spikes=spikes,
                    kv_dtype=kv_dtype,
                )
                steps.update()
                rows.append(
                    [
                        scenario,
                        label,
                        f"{r['cosine_mean']:.5f}",
                        f"{r['cosine_min']:.5f}",
                        f"{r['top1_agreement']:.1%}",
                        f"{r['greedy_agreement']:.1%}",
                        f"{r['greedy_identical_answers']}/{r['prompts']}",
                        f"{r['mean_tokens_before_divergence']:.1f}",
                    ]
                )
        steps.close()
    return markdown_table(
        [
            "scenario",
            "variant vs fp32",
            "logit cosine (mean)",
            "logit cosine (min)",
            "top-1 agreement (teacher-forced)",
            "greedy token agreement",
            f"identical {tokens}-token answers",
            "tokens before first difference",
        ],
        rows,
    )


def quantized(args, kind: str) -> Path:
    """The source's quantized copy of CHECKPOINTS `kind` (INT8: the suite's), written if missing."""
    if kind == "int8":
        return int8_suite.int8_copy(args)
    path = args.model_path.with_name(f"{args.model_path.name}-{kind}")
    if not (path / "config.json").exists():
        from service.quant.writer import write_quantized

        write_quantized(args.model_path, path, **CHECKPOINTS[kind])
    return path


def main(argv=None) -> int:
    args = int8_suite.parse(int8_suite.parser(__doc__), argv)
    variants = select(args.fidelity_bits)
    checkpoints = {kind: quantized(args, kind) for kind in {v[0] for v in variants.values()}}
    body = run(args.model_path, checkpoints, args.threads, args.fidelity_tokens, variants)
    int8_suite.save(
        args,
        f"{'INT8' if args.fidelity_bits == 'int8' else 'INT8 and 4-bit'} fidelity against fp32 "
        f"({args.model_path.name})",
        body,
        greedy_tokens=args.fidelity_tokens,
        prompts=f"{len(TEXT_PROMPTS)} text + {len(IMAGE_PROMPTS)} with a 1080p photo",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
