"""INT8 versus fp32 fidelity on a fixed prompt set: logit cosine similarity and greedy-token agreement.

The fp32 model answers each prompt greedily (`reference`, one process); each INT8 variant (its own
process, `compare`) then reads the same token sequences (teacher forcing) — logit cosine and top-1
agreement at every answer position — and also answers freely, compared token by token.
"""

from __future__ import annotations

from bench.harness import encoded_photo

TEXT_PROMPTS = [
    "What is the capital of France? Answer in one word.",
    "Tell me a story about a red square that travels across a blue sky.",
    "List three colors, then three shapes.",
    "Explain why the sky is blue to a child.",
]
IMAGE_PROMPTS = ["Describe this picture.", "How many circles are in this image, and what colors are they?"]

VARIANTS = {  # label → (checkpoint, qconfig name, int8 embedding)
    "int8 per-channel, int8 embedding (shipped)": ("int8", "per_channel", True),
    "int8 per-channel, fp32 embedding": ("source", "per_channel", False),
    "int8 per-tensor, fp32 embedding (torch default)": ("source", "per_tensor", False),
}


def _inputs(engine, index: int) -> dict:
    """generate/forward kwargs for prompt `index` (image prompts get a 1080p photo at the pixel budget)."""
    import torch

    from service.engine import GenerationRequest
    from service.images import decode_image
    from service.prompts import ChatMessage, ImagePart, TextPart

    if index < len(TEXT_PROMPTS):
        parts = [TextPart(TEXT_PROMPTS[index])]
    else:
        image = decode_image(encoded_photo(".jpg"), engine.loaded.image_limits)
        parts = [ImagePart(image), TextPart(IMAGE_PROMPTS[index - len(TEXT_PROMPTS)])]
    prompt = engine.prepare(GenerationRequest([ChatMessage("user", parts)]))
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


def _answer_logits(model, kwargs: dict, sequence, prompt_len: int):
    import torch

    model.model.rope_deltas = None
    with torch.inference_mode():
        logits = model(**_extended(kwargs, sequence)).logits[0]
    return logits[prompt_len - 1:-1].float()


def _greedy(model, kwargs: dict, tokens: int):
    import torch

    model.model.rope_deltas = None
    with torch.inference_mode():
        return model.generate(**kwargs, attention_mask=torch.ones_like(kwargs["input_ids"]), max_new_tokens=tokens,
                              min_new_tokens=tokens, do_sample=False)


def _engine(model_path: str, threads: int, quantization: str, qconfig: str | None = None, int8_embedding=True):
    from service.engine import Engine
    from service.loading import load_model
    from service.quantized import quantize_in_place
    from service.settings import load_settings

    if qconfig is None:
        settings = load_settings(model_path=model_path, threads=threads, quantization=quantization, cache_enabled=False)
        return Engine(load_model(settings), settings)
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig

    settings = load_settings(model_path=model_path, threads=threads, quantization="fp32", cache_enabled=False)
    loaded = load_model(settings)  # fp32, then quantized here the way the variant says
    quantize_in_place(loaded.model, per_channel_dynamic_qconfig if qconfig == "per_channel" else default_dynamic_qconfig,
                      int8_embedding=int8_embedding)
    return Engine(loaded, settings)


def reference(model_path: str, threads: int, tokens: int, out_file: str) -> dict:
    """fp32: greedy answers and their logits for every prompt, saved to `out_file`."""
    import torch

    engine = _engine(model_path, threads, "fp32")
    saved = []
    for i in range(len(TEXT_PROMPTS) + len(IMAGE_PROMPTS)):
        kwargs = _inputs(engine, i)
        sequence = _greedy(engine.model, kwargs, tokens)
        prompt_len = kwargs["input_ids"].shape[1]
        saved.append({"sequence": sequence, "prompt_len": prompt_len,
                      "logits": _answer_logits(engine.model, kwargs, sequence, prompt_len)})
    torch.save(saved, out_file)
    return {"prompts": len(saved)}


def compare(model_path: str, threads: int, tokens: int, ref_file: str, qconfig: str, int8_embedding: bool,
            prequantized: bool) -> dict:
    """One INT8 variant against the saved fp32 reference."""
    import torch

    engine = (_engine(model_path, threads, "int8") if prequantized
              else _engine(model_path, threads, "int8", qconfig, int8_embedding))
    cosines, top1, free_same, free_prefix = [], [], [], []
    for i, ref in enumerate(torch.load(ref_file)):
        kwargs = _inputs(engine, i)
        logits = _answer_logits(engine.model, kwargs, ref["sequence"], ref["prompt_len"])
        cosines.append(torch.nn.functional.cosine_similarity(logits, ref["logits"], dim=-1))
        top1.append((logits.argmax(-1) == ref["logits"].argmax(-1)).float())
        answer = _greedy(engine.model, kwargs, tokens)[0, ref["prompt_len"]:]
        expected = ref["sequence"][0, ref["prompt_len"]:]
        same = (answer == expected).tolist()
        free_same.append(sum(same) / len(same))
        free_prefix.append(same.index(False) if False in same else len(same))
    cos = torch.cat(cosines)
    return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
            "top1_agreement": float(torch.cat(top1).mean()), "greedy_agreement": sum(free_same) / len(free_same),
            "greedy_identical_answers": sum(p == tokens for p in free_prefix), "prompts": len(free_prefix),
            "mean_tokens_before_divergence": sum(free_prefix) / len(free_prefix)}


def run(source, int8, threads: int, tokens: int) -> str:
    """All variants against fp32 on checkpoint `source` (pre-quantized copy `int8`): a markdown table."""
    import tempfile
    from pathlib import Path

    from tqdm import tqdm

    from bench.harness import isolated
    from bench.results import markdown_table

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ref = str(Path(tmp) / "fp32.pt")
        steps = tqdm(total=1 + len(VARIANTS), desc=f"fidelity {Path(source).name}", unit="process")
        isolated("bench.fidelity:reference", model_path=str(source), threads=threads, tokens=tokens, out_file=ref)
        steps.update()
        for label, (which, qconfig, int8_embedding) in VARIANTS.items():
            r = isolated("bench.fidelity:compare", model_path=str(int8 if which == "int8" else source),
                         threads=threads, tokens=tokens, ref_file=ref, qconfig=qconfig,
                         int8_embedding=int8_embedding, prequantized=which == "int8")
            steps.update()
            rows.append([label, f"{r['cosine_mean']:.5f}", f"{r['cosine_min']:.5f}", f"{r['top1_agreement']:.1%}",
                         f"{r['greedy_agreement']:.1%}", f"{r['greedy_identical_answers']}/{r['prompts']}",
                         f"{r['mean_tokens_before_divergence']:.1f}"])
        steps.close()
    return markdown_table(["INT8 variant vs fp32", "logit cosine (mean)", "logit cosine (min)",
                           "top-1 agreement (teacher-forced)", "greedy token agreement",
                           f"identical {tokens}-token answers", "tokens before first difference"], rows)
