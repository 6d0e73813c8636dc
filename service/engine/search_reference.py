"""The official code's reading of a search checkpoint, for comparing the service's with it: transformers'
Qwen3-VL backbone (`Qwen3VLForConditionalGeneration.model`, fp32) with the official pooling
(QwenLM/Qwen3-VL-Embedding at 8ce3aab) — an embedding is the backbone's last hidden state at the last
token, L2-normalised; a score is sigmoid(h · (lm_head["yes"] − lm_head["no"])) at the last token. It
takes the service's prompts (the official format, service/model/search_prompts.py) as the service
tokenizes and patchifies them, so what it checks is the forward and the pooling. Used by
`python -m service compare-search` and the tests; never to serve."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.prompts import PreparedPrompt


def reference_model(path: Path):
    """transformers' model of the checkpoint at `path`, fp32, for reading (a headless embedding
    checkpoint's missing lm_head is left as transformers initialises it: the embedding never reads it)."""
    from transformers import AutoConfig

    from ..quant.fusion import model_class

    config = AutoConfig.from_pretrained(path)
    model = model_class(config).from_pretrained(path, dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model


def _last_hidden(model, prompt: PreparedPrompt) -> torch.Tensor:
    inputs = dict(input_ids=prompt.input_ids, mm_token_type_ids=prompt.mm_token_type_ids)
    if prompt.pixel_values:
        inputs.update(pixel_values=torch.cat(prompt.pixel_values), image_grid_thw=prompt.image_grid_thw)
    if len(prompt.pixel_values_videos):
        inputs.update(
            pixel_values_videos=torch.cat(list(prompt.pixel_values_videos)), video_grid_thw=prompt.video_grid_thw
        )
    with torch.inference_mode():
        return model.model(**inputs).last_hidden_state[0, -1]


def official_embedding(model, prompt: PreparedPrompt) -> torch.Tensor:
    """Qwen3VLEmbedder's vector of one prompt: the last token's hidden state, L2-normalised."""
    return F.normalize(_last_hidden(model, prompt), p=2, dim=-1)


def official_score(model, prompt: PreparedPrompt, yes: int, no: int) -> float:
    """Qwen3VLReranker's score of one pair: sigmoid of the last hidden state times lm_head[yes] − lm_head[no]."""
    weight = model.lm_head.weight
    return float(torch.sigmoid(_last_hidden(model, prompt) @ (weight[yes] - weight[no])))
