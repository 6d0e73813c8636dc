"""The decode step (service/decoder.py) on the real tiny model: what transformers' forward computes,
alone and in a batch, fp32 and INT8."""

from __future__ import annotations

import pytest
import torch

from service.caches import copy_prefix
from service.decoder import DecodeStep
from service.kv import GrowingCache
from service.loading import load_model

from conftest import make_settings

PROMPTS = [
    "Hi.",
    "Tell me a long story about a red square and a blue circle, please.",
    "What is the capital of a small country?",
]
STEPS = 24


@pytest.fixture(scope="module", params=["fp32", "int8"])
def loaded(request, cache_dir, tiny_dir):
    return load_model(make_settings(cache_dir, quantization=request.param))


def prefilled(loaded):
    """Each prompt's KV cache (transformers' forward) and its greedy first token."""
    model, out = loaded.model, []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = loaded.processor.tokenizer(prompt, return_tensors="pt").input_ids
            cache = GrowingCache(config=model.config)
            positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
            logits = model(input_ids=ids, position_ids=positions, cache=cache, logits_to_keep=1).logits[0, -1]
            out.append((cache, int(logits.argmax())))
    return out


def copies(model, caches):
    return [copy_prefix(c, c.get_seq_length(), model.config) for c, _ in caches]


def greedy_with_transformers(model, cache, token, rope_delta=0):
    tokens, logits = [], []
    with torch.inference_mode():
        for _ in range(STEPS):
            position = torch.tensor([cache.get_seq_length() + rope_delta]).view(1, 1, 1).expand(3, 1, 1)
            row = model(input_ids=torch.tensor([[token]]), position_ids=position, cache=cache, logits_to_keep=1).logits[
                0, -1
            ]
            token = int(row.argmax())
            tokens.append(token)
            logits.append(row)
    return tokens, logits


def greedy_with_step(step, caches, tokens, rope_deltas):
    """All sequences decoded together; per sequence its tokens and logits."""
    out_tokens, out_logits = [[] for _ in caches], [[] for _ in caches]
    tokens = list(tokens)
    for _ in range(STEPS):
        positions = torch.tensor([c.get_seq_length() + d for c, d in zip(caches, rope_deltas)])
        rows = step(torch.tensor(tokens), positions, caches)
        for b in range(len(caches)):
            tokens[b] = int(rows[b].argmax())
            out_tokens[b].append(tokens[b])
            out_logits[b].append(rows[b])
    return out_tokens, out_logits


def greedy_batch_with_transformers(model, caches, tokens, rope_delta):
    """The sequences decoded together through transformers' forward: left-padded into one cache
    with an attention mask (how the scheduler batched before the decode step)."""
    width = max(c.get_seq_length() for c in caches)
    pad = torch.tensor([width - c.get_seq_length() for c in caches])
    packed = GrowingCache(
        config=model.config,
        ddp_cache_data=[
            tuple(
                torch.cat(
                    [
                        torch.nn.functional.pad(getattr(c.layers[i], kind), (0, 0, int(p), 0))
                        for c, p in zip(caches, pad)
                    ]
                )
                for kind in ("keys", "values")
            )
            for i in range(len(caches[0].layers))
        ],
    )
    lengths = torch.tensor([c.get_seq_length() for c in caches])
    tokens, logits = torch.tensor(tokens), []
    with torch.inference_mode():
        for i in range(STEPS):
            mask = (torch.arange(width + i + 1)[None, :] >= pad[:, None]).long()
            positions = (lengths + i + rope_delta).view(1, -1, 1).expand(3, -1, 1)
            rows = model(
                input_ids=tokens[:, None], position_ids=positions, attention_mask=mask, cache=packed, logits_to_keep=1
            ).logits[:, -1]
            tokens = rows.argmax(-1)
            logits.append(rows)
    return [[step[b] for step in logits] for b in range(len(caches))]


@pytest.mark.parametrize("rope_delta", [0, -37], ids=["text", "after a picture"])
def test_the_step_decodes_what_transformers_forward_decodes_alone_and_in_a_batch(loaded, rope_delta):
    """A picture shifts the positions after it (M-RoPE): `rope_delta` plays that shift."""
    model = loaded.model
    caches = prefilled(loaded)
    firsts = [t for _, t in caches]
    expected = [
        greedy_with_transformers(model, cache, token, rope_delta) for cache, token in zip(copies(model, caches), firsts)
    ]
    step = DecodeStep(model)
    alone = [
        greedy_with_step(step, [cache], [token], [rope_delta]) for cache, token in zip(copies(model, caches), firsts)
    ]
    together = greedy_with_step(step, copies(model, caches), firsts, [rope_delta] * len(caches))
    batch_reference = greedy_batch_with_transformers(model, copies(model, caches), firsts, rope_delta)
    # Float rounding apart (attention's summation order, fp32 GEMMs of B rows): within 1e-5 of the
    # logits' size in fp32; INT8 rounds activations, so a last-bit difference may move one level.
    tolerance = 1e-5 if loaded.quantization == "fp32" else 1e-3

    def worst(got, want):
        return max(float((a - e).abs().max() / e.abs().max().clamp_min(1)) for a, e in zip(got, want, strict=True))

    for b, (tokens, logits) in enumerate(expected):
        assert alone[b][0][0] == tokens and together[0][b] == tokens
        assert worst(alone[b][1][0], logits) < tolerance
        assert worst(together[1][b], batch_reference[b]) < tolerance
        if loaded.quantization == "int8":  # per-token Linears, per-sequence attention: the same bits
            assert all(torch.equal(a, t) for a, t in zip(alone[b][1][0], together[1][b], strict=True))


def test_the_step_extends_each_sequences_own_cache_by_one_token(loaded):
    model = loaded.model
    caches = copies(model, prefilled(loaded))
    lengths = [c.get_seq_length() for c in caches]
    DecodeStep(model)(torch.tensor([1, 2, 3]), torch.tensor(lengths), caches)
    assert [c.get_seq_length() for c in caches] == [n + 1 for n in lengths]
