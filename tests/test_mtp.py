"""Qwen3.5's multi-token prediction head (the checkpoint's `mtp.*`) as the drafter of exact speculative
decoding (service/model/mtp.py, service/engine/mtp_drafts.py), on `tiny-qwen35` and `tiny-qwen35-moe`.

The head loads from the checkpoint as it stores it — fp32, quantized at load, and in the INT8 and 4-bit
checkpoints `quantize` writes (a mixture of experts' head with its experts) — and computes, in fp32, what
its weights compute read as vLLM reads them. Through the engine a greedy or seeded answer is the same bits
with the head guessing and with no guesses at all, alone and in a batch, after a cache hit from memory or
from disk, and paused and resumed; and the head's own keys and values — one entry for every prompt
position and every accepted token, none for a guess — are the bits a recompute of the same tokens gives,
whichever of those paths made them. Every engine test checks the head did guess (its guesses are counted
under their own source), so none passes with the head idle. The weights are random: the guesses are
noise, and nothing here claims speed.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_batching import Stream
from test_caches import assistant, image, metric, user
from test_forward import prompt_rows
from test_priorities import background_request, preempted_run, run, same_bits

from service.engine.engine import Engine, GenerationRequest, SamplingParams
from service.model.forward import Rows
from service.model.loading import load_model
from service.model.mtp import MTPHead
from service.model.prompts import ChatMessage, ImagePart, TextPart

from conftest import built_preset, make_settings, transformers_model

PRESETS = ["tiny-qwen35", "tiny-qwen35-moe"]
WEIGHTS = pytest.mark.parametrize("weights", ["int8", "int4"])


@pytest.fixture(scope="module", params=PRESETS)
def preset_dir(request, cache_dir):
    return built_preset(cache_dir, request.param)


@pytest.fixture(scope="module")
def quantized_dirs(cache_dir, preset_dir):
    """The preset as `python -m service quantize` writes it (INT8) and `--bits 4`: head included."""
    from service.quant.writer import write_quantized

    dirs = {
        "int8-checkpoint": cache_dir / f"{preset_dir.name}-mtp-int8",
        "int4": cache_dir / f"{preset_dir.name}-mtp-int4",
    }
    for kind, path in dirs.items():
        if not (path / "config.json").exists():
            write_quantized(preset_dir, path, progress=False, bits=4 if kind == "int4" else 8)
    return dirs


@pytest.fixture(scope="module")
def engines(cache_dir, preset_dir, quantized_dirs):
    """engines(weights, **settings): fp32, int8 (quantized at load), "int8-checkpoint" and "int4" (the
    quantized checkpoints), the native INT8 kernel; a model loaded once per weights."""
    made, loaded = {}, {}

    def get(weights: str, **settings) -> Engine:
        key = (weights, tuple(sorted(settings.items())))
        if key not in made:
            path = quantized_dirs.get(weights, preset_dir)
            quantization = "fp32" if weights == "fp32" else "int8"
            s = make_settings(cache_dir, model_path=path, quantization=quantization, int8_kernel="native", **settings)
            if weights not in loaded:
                loaded[weights] = load_model(s)
            made[key] = Engine(loaded[weights], s)
        return made[key]

    return get


def mtp_guesses() -> float:
    """The head's guesses verified so far in this process (accepted or not)."""
    return sum(metric("qwen3vl_draft_tokens_total", source="mtp", result=r) for r in ("accepted", "rejected"))


def greedy(parts, max_tokens=24, conversation_id=None, **params) -> GenerationRequest:
    return asked([ChatMessage("user", parts)], max_tokens, conversation_id, **params)


def asked(messages, max_tokens=24, conversation_id=None, **params) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=max_tokens, **{"temperature": 0, "logprobs": 3, **params})
    return GenerationRequest(messages, sampling, conversation_id=conversation_id)


def same_head(a, b) -> bool:
    """Two caches' head parts: the same entries, keys and values, and unread hidden state, bit for bit."""
    return (
        a.entries == b.entries
        and torch.equal(a.layer.keys, b.layer.keys)
        and torch.equal(a.layer.values, b.layer.values)
        and torch.equal(a.hidden, b.hidden)
    )


def kept(engine: Engine, conversation_id: str):
    """The cache the engine's memory tier keeps for a conversation."""
    return engine.caches.kv.memory.entries.peek(f"id:{conversation_id}")


# -- loading ------------------------------------------------------------------------------------------


def test_the_head_holds_the_checkpoints_mtp_tensors_and_is_left_out_when_asked(cache_dir, preset_dir):
    """fp32: the head's fc, norms and decoder layer are the checkpoint's `mtp.*` tensors (q/k/v and gate/up
    side by side as the forward fuses them, a mixture of experts' experts one by one); MTP_DRAFTING=off
    loads none of it."""
    stored = load_file(preset_dir / "model.safetensors")
    head = load_model(make_settings(cache_dir, model_path=preset_dir, quantization="fp32")).model.mtp
    layer = head.layers[0]
    assert torch.equal(head.fc.weight, stored["mtp.fc.weight"])
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert torch.equal(getattr(head, norm).weight, stored[f"mtp.{norm}.weight"])
    qkv = torch.cat([stored[f"mtp.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    assert torch.equal(layer.self_attn.o_proj.weight, stored["mtp.layers.0.self_attn.o_proj.weight"])
    if hasattr(layer.mlp, "experts"):
        experts = layer.mlp.experts
        for e in range(experts.num_experts):
            gate_up = torch.cat([stored[f"mtp.layers.0.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up")])
            assert torch.equal(experts.gate_up[e].weight, gate_up)
            assert torch.equal(experts.down[e].weight, stored[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"])
        assert torch.equal(layer.mlp.gate.weight, stored["mtp.layers.0.mlp.gate.weight"])
    else:
        gate_up = torch.cat([stored[f"mtp.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
    off = make_settings(cache_dir, model_path=preset_dir, mtp_drafting="off")
    loaded = load_model(off)
    assert loaded.model.mtp is None and Engine(loaded, off).head is None


def test_the_quantized_checkpoints_carry_the_head(engines, quantized_dirs):
    """`quantize` writes the head's Linears (INT8, or 4-bit with `--bits 4`) and its norms; the INT8
    checkpoint's head computes the bits quantizing at load gives."""
    from service.quant.int4_linear import Int4Linear
    from service.quant.int8_linear import Int8Linear

    for path in quantized_dirs.values():
        names = [n for f in path.glob("*.safetensors") for n in load_file(f)]
        assert any(n.startswith("mtp.fc.") for n in names) and "mtp.norm.weight" in names
    heads = {w: engines(w).model.mtp for w in ("int8", "int8-checkpoint", "int4")}
    assert isinstance(heads["int8"].fc, Int8Linear) and isinstance(heads["int8-checkpoint"].fc, Int8Linear)
    assert isinstance(heads["int4"].fc, Int4Linear)
    assert isinstance(heads["int4"].layers[0].self_attn.qkv_proj, Int4Linear)
    outputs = []
    for weights in ("int8", "int8-checkpoint"):
        engine = engines(weights)
        cache = engine.forward.new_cache(torch.float32, draft=True)
        ids = torch.tensor([5, 17, 33, 2, 90, 41, 7])
        engine.forward(ids, torch.arange(len(ids)), [Rows(cache, len(ids))])
        taken = cache.draft.take(len(ids) - 1)
        outputs.append(MTPHead(engine.model.mtp, engine.forward)(*taken, [cache.draft], [len(ids) - 1]))
    assert torch.equal(outputs[0], outputs[1])


def test_a_checkpoint_without_the_head_serves_without_it(cache_dir, preset_dir, tmp_path):
    """A copy that left the `mtp.*` tensors out (its config still names the head) loads and answers,
    guessing by prompt lookup."""
    copy = tmp_path / "no-head"
    shutil.copytree(preset_dir, copy)
    tensors = load_file(copy / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if not n.startswith("mtp.")}, copy / "model.safetensors")
    settings = make_settings(cache_dir, model_path=copy, int8_kernel="native", cache_enabled=False)
    loaded = load_model(settings)
    engine = Engine(loaded, settings)
    assert loaded.model.mtp is None and engine.head is None
    assert run(engine, greedy([TextPart("Hello there.")], max_tokens=8)).completion_tokens == 8


def test_the_heads_parameters_docs_models_md_gives_are_the_presets():
    """docs/models.md's table: each Qwen3.5 preset's parameters, and of them the head's, from the tensors
    its checkpoint stores (the meta device: no memory)."""
    import math
    from pathlib import Path

    from service.random_checkpoints.presets import model_config
    from service.random_checkpoints.random_weights import checkpoint_shapes

    text = (Path(__file__).parents[1] / "docs" / "models.md").read_text().split("## Qwen3.5's MTP head")[1]
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| `qwen3.5-")]
    assert len(rows) == 5
    for name, total, head in rows:
        shapes = checkpoint_shapes(model_config(name.strip().strip("`")))
        count = {n: math.prod(s) for n, s in shapes.items()}
        assert int(total.replace(",", "")) == sum(count.values())
        assert int(head.replace(",", "")) == sum(n for k, n in count.items() if k.startswith("mtp."))


# -- what the head computes -----------------------------------------------------------------------------


def reference_head(model, stored: dict[str, torch.Tensor]):
    """The head as vLLM reads the `mtp.*` tensors, built of transformers' own Qwen3.5 modules (the model's
    decoder layer class for a full-attention layer, its RMSNorm) and loaded with the checkpoint's tensors."""
    from service.quant.structure import skeleton

    head = skeleton(model.config).mtp.to_empty(device="cpu")
    state = {}
    for name in head.state_dict():
        key = f"mtp.{name}"
        if key in stored:
            state[name] = stored[key]
        else:  # transformers keeps a layer's experts as two 3-D tensors; the releases one Linear each
            prefix, _, tensor = key.rpartition(".")
            count = model.config.text_config.num_experts
            parts = ("gate", "up") if tensor == "gate_up_proj" else ("down",)
            state[name] = torch.stack(
                [torch.cat([stored[f"{prefix}.{e}.{p}_proj.weight"] for p in parts]) for e in range(count)]
            )
    head.load_state_dict(state)
    return head.eval()


def test_the_head_computes_what_its_weights_compute_read_as_vllm_reads_them(engines, preset_dir):
    """fp32, every position of a prompt: the model's final-normed hidden state at p beside the embedding of
    token p + 1, each normed, through fc, the head's full-attention layer (causal, at position p) and its
    norm, then the model's lm_head — computed by transformers' modules from the model's hidden states, and
    by the service's head from its forward's: the same logits within float rounding, the same argmax."""
    from transformers.masking_utils import create_causal_mask

    engine = engines("fp32")
    model = transformers_model(preset_dir)
    text = model.model.language_model
    head = reference_head(model, load_file(preset_dir / "model.safetensors"))
    ids = torch.tensor([[11, 305, 42, 7, 512, 88, 3, 260, 19, 77, 140, 9, 31, 650, 2, 48]])
    with torch.no_grad():
        hidden = text(input_ids=ids).last_hidden_state
        x = head.fc(
            torch.cat(
                [head.pre_fc_norm_embedding(text.embed_tokens(ids[:, 1:])), head.pre_fc_norm_hidden(hidden[:, :-1])], -1
            )
        )
        positions = torch.arange(ids.shape[1] - 1).view(1, 1, -1).expand(3, 1, -1)
        mask = create_causal_mask(
            config=text.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions[0]
        )
        x = head.layers[0](x, position_embeddings=text.rotary_emb(x, positions), attention_mask=mask)
        expected = model.lm_head(head.norm(x))[0]

    cache = engine.forward.new_cache(torch.float32, draft=True)
    engine.forward(ids[0], torch.arange(ids.shape[1]), [Rows(cache, ids.shape[1])])
    ours = MTPHead(engine.model.mtp, engine.forward)
    got = ours.logits(ours(*cache.draft.take(ids.shape[1] - 1), [cache.draft], [ids.shape[1] - 1]))
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-4


def test_after_a_picture_the_head_reads_its_features_as_vllm_merges_them(engines):
    """Where token p + 1 is a picture's placeholder, the head pairs the hidden state at p with that
    placeholder's vision feature — the row the model was fed there — not the placeholder's embedding."""
    engine = engines("int8")
    rows = prompt_rows(engine, [ImagePart(image(engine, 160, 128, seed=2)), TextPart("What is this?")])
    cache = engine.forward.new_cache(torch.float32, draft=True)
    engine.forward(*rows.piece(cache, 0, len(rows.ids)))
    placeholders = (rows.types == 1).nonzero()[:, 0]
    read = cache.draft.embedded[placeholders - 1]  # the embedding paired with position p is token p + 1's
    assert torch.equal(read, rows.features["image"].pooler)
    assert not torch.equal(read[0], engine.forward.embed_tokens(rows.ids[placeholders[:1]])[0])


# -- through the engine: the same bits, the head's entries -----------------------------------------------


def three_requests(engine) -> list[GenerationRequest]:
    return [
        greedy([TextPart("Hi.")]),
        greedy([ImagePart(image(engine, 256, 256)), TextPart("What is in this picture, in detail?")]),
        greedy([TextPart("Tell me a long story about a red square, please.")], max_tokens=20),
    ]


@WEIGHTS
def test_greedy_and_seeded_answers_are_the_same_bits_with_the_head_guessing_or_no_guesses(engines, weights):
    """Alone with no guesses, alone with the head's, and in a batch of five: the same tokens and every
    log-probability as floats, greedy and seeded sampling; the head guessed."""
    engine = engines(weights, max_batch_size=5, prefill_chunk_tokens=24, cache_enabled=False)
    requests = three_requests(engine)
    story = [TextPart("Tell me a long story about a red square, please.")]
    requests += [greedy(story, 20, temperature=0.9, seed=seed, logprobs=2) for seed in (3, 4)]
    without = [run(engine, dataclasses.replace(r, speculative=False)) for r in requests]
    before = mtp_guesses()
    alone = [run(engine, r) for r in requests]
    guessed = mtp_guesses() - before
    streams = [Stream(engine, r).start() for r in requests]
    together = [s.join().done for s in streams]
    assert guessed > 0 and sum(d.drafted_tokens for d in alone) == guessed
    assert len({tuple(d.token_ids) for d in without}) == len(requests)
    for a, b, c in zip(without, alone, together, strict=True):
        assert same_bits(a, b) and same_bits(a, c)


@WEIGHTS
def test_the_heads_entries_are_those_a_recompute_of_the_same_tokens_gives(engines, weights):
    """A conversation answered alone and the same one in a batch keep the head's entries for every
    position but the last (none for a guess) and the hidden state at the last, bit for bit as a prefill
    of the same tokens makes them; a request with no guesses keeps no head part."""
    engine = engines(weights, max_batch_size=3, kv_dtype="float32")
    parts = [TextPart("Tell me a long story about a red square and a blue circle, please.")]
    run(engine, greedy(parts, 32, "alone"))
    streams = [
        Stream(engine, greedy(parts, 32, "batched")).start(),
        Stream(engine, greedy([TextPart("Hi.")], 32)).start(),
    ]
    for s in streams:
        s.join()
    run(engine, dataclasses.replace(greedy(parts, 32, "unguessed"), speculative=False))
    alone, batched = kept(engine, "alone"), kept(engine, "batched")
    tokens = alone.token_ids
    assert torch.equal(batched.token_ids, tokens) and kept(engine, "unguessed").cache.draft is None
    assert alone.cache.draft.entries == len(tokens) - 1 and alone.cache.draft.pending == 1
    recomputed = engine.forward.new_cache(torch.float32, draft=True)
    engine.forward(tokens, torch.arange(len(tokens)), [Rows(recomputed, len(tokens))])
    engine.head.settle([recomputed.draft])
    assert same_head(alone.cache.draft, recomputed.draft) and same_head(batched.cache.draft, recomputed.draft)


def test_unread_rows_read_without_guessing_leave_the_same_entries(engines, monkeypatch):
    """A sequence that does not guess for a while (its budget paused after misses) has its unread rows
    read anyway once MAX_UNREAD gather (here: at once): the same answer, the same entries."""
    from service.engine import mtp_drafts

    monkeypatch.setattr(mtp_drafts, "MAX_UNREAD", 1)
    engine = engines("int8", kv_dtype="float32")
    parts = [TextPart("Tell me a long story about a red square and a blue circle, please.")]
    done = run(engine, greedy(parts, 40, "read"))
    assert 0 < done.drafted_tokens < done.completion_tokens - 1  # some steps guessed, some did not
    assert same_bits(done, run(engine, dataclasses.replace(greedy(parts, 40), speculative=False)))
    tokens = kept(engine, "read").token_ids
    recomputed = engine.forward.new_cache(torch.float32, draft=True)
    engine.forward(tokens, torch.arange(len(tokens)), [Rows(recomputed, len(tokens))])
    engine.head.settle([recomputed.draft])
    assert same_head(kept(engine, "read").cache.draft, recomputed.draft)


@WEIGHTS
def test_a_second_turn_from_memory_or_disk_guesses_and_answers_as_a_fresh_computation(
    engines, cache_dir, tmp_path, weights
):
    """A picture conversation's first turn kept in memory and on disk (the head's keys and values beside
    the model's, its hidden state beside each recurrent state), the store copied as a restart finds it:
    the second turn resumed from memory, from disk and computed fresh has the same bits, makes the same
    guesses (so the same counts), and leaves the same head entries."""
    loaded = engines(weights).loaded

    def tiered(folder, **settings) -> Engine:
        s = make_settings(cache_dir, model_path=loaded.path, int8_kernel="native", kv_disk_dir=folder, **settings)
        return Engine(loaded, s)

    first = tiered(tmp_path / "kv")
    history = [user(image(first, seed=5), "Describe the picture, please.")]
    done = run(first, asked(history, 24, "A"))
    assert first.caches.kv.disk.flush(30)
    shutil.copytree(tmp_path / "kv", tmp_path / "copy")
    follow = history + [assistant(done.text), user("Tell me more.")]
    second = asked(follow, 24, "A")
    fresh_engine = tiered(tmp_path / "none", kv_disk_mb=0)
    disk_engine = tiered(tmp_path / "copy")
    before = mtp_guesses()
    from_memory, from_disk, fresh = run(first, second), run(disk_engine, second), run(fresh_engine, second)
    assert mtp_guesses() > before
    assert (from_memory.cached_from, from_disk.cached_from, fresh.cached_from) == ("memory", "disk", None)
    assert from_disk.cached_tokens == from_memory.cached_tokens > 0
    assert same_bits(from_memory, fresh) and same_bits(from_disk, fresh)
    counts = {(d.drafted_tokens, d.accepted_tokens) for d in (from_memory, from_disk, fresh)}
    assert len(counts) == 1 and next(iter(counts))[0] > 0
    heads = [kept(e, "A").cache.draft for e in (first, disk_engine, fresh_engine)]
    assert same_head(heads[0], heads[2]) and same_head(heads[1], heads[2])
    branch = run(first, asked(follow, 24, "B"))  # another conversation: a copy of A's prefix
    assert branch.cached_from == "memory" and same_bits(branch, fresh)
    assert (branch.drafted_tokens, branch.accepted_tokens) == (fresh.drafted_tokens, fresh.accepted_tokens)
    assert same_head(kept(first, "B").cache.draft, heads[2])


@WEIGHTS
def test_a_cache_cut_back_or_copied_to_a_snapshot_holds_the_heads_entries_a_recompute_gives(engines, weights):
    """A prompt prefilled in pieces, its state kept at each piece's end: cut back (or copied) to any of
    them, the cache's head part is the bits a prefill of that many tokens leaves."""
    engine = engines(weights)
    ids = torch.tensor([11, 305, 42, 7, 512, 88, 3, 260, 19, 77, 140, 9, 31, 650, 2, 48, 17, 5, 90, 61])
    ends = [3, 8, 9, 15, len(ids)]

    def prefilled(length: int, snapshots=()):
        cache, start = engine.forward.new_cache(torch.float32, draft=True), 0
        for end in [e for e in ends if e < length] + [length]:
            engine.forward(ids[start:end], torch.arange(start, end), [Rows(cache, end - start)])
            engine.head.settle([cache.draft])
            if end in snapshots:
                cache.snapshot()
            start = end
        return cache

    whole = prefilled(len(ids), ends)
    for length in reversed(ends[:-1]):
        assert same_head(whole.prefix(length).draft, prefilled(length).draft), length
        whole.crop(length - whole.get_seq_length())
        assert same_head(whole.draft, prefilled(length).draft), length


@WEIGHTS
def test_a_paused_answer_guesses_and_answers_as_one_never_paused(engines, weights):
    """A batch of one: a less urgent answer pauses (its head entries and unread rows kept) while an urgent
    one runs, then resumes — the same bits, guesses and head entries as never paused."""
    engine = engines(weights, max_batch_size=1, queue_size=4, prefill_chunk_tokens=24)
    expected = run(engine, background_request(engine, "greedy", "never-paused"))
    low, _, seen = preempted_run(engine, background_request(engine, "greedy", "paused"))
    assert low.preempted == 1 and "paused" in seen
    assert same_bits(low, expected) and low.drafted_tokens == expected.drafted_tokens > 0
    assert low.accepted_tokens == expected.accepted_tokens
    assert same_head(kept(engine, "paused").cache.draft, kept(engine, "never-paused").cache.draft)


def test_an_answer_is_the_same_whether_the_head_or_prompt_lookup_guesses(engines):
    """MTP_DRAFTING=off guesses by prompt lookup instead: the same bits (neither guesser changes an answer)."""
    engine = engines("int8", cache_enabled=False)
    lookup = Engine(engine.loaded, engine.settings.model_copy(update={"mtp_drafting": "off"}))
    assert engine.head is not None and lookup.head is None
    for request in three_requests(engine):
        assert same_bits(run(engine, request), run(lookup, request))
