"""Qwen3.5 (`qwen3_5`, `qwen3_5_moe`) on `tiny-qwen35` and `tiny-qwen35-moe`: three linear-attention
(Gated DeltaNet) layers to one full-attention layer, a shared expert beside the routed ones, the MTP
head's tensors, Qwen3.5's tokens and prompt format.

The service's forward computes what transformers' Qwen3.5 forward computes (fp32, within float
rounding, the same greedy tokens); with INT8 weights a token gets the same bits — logits, keys and
values and the recurrent states — whichever path computes it: a prompt in one piece or in pieces, a
generated token or the same token recomputed, alone or in a batch, after a decode step's guesses were
taken back; and through the engine a greedy answer's every log-probability is the same alone, in a
batch, with speculation on or off, and after a cache hit. The presets' shapes are the releases'."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_batching import Stream, request
from test_caches import Engines, assistant, converse, image, turn, user
from test_forward import a_picture_and_a_question, decode, pieces, prefill, prompt_rows, same_kv, transformers_greedy
from test_int4 import copied_without_weights, greedy, publish_linear, save_published

from service.engine.engine import Engine, GenerationRequest
from service.model.attention import ExactAttention
from service.model.deltanet import RecurrentLayer
from service.model.forward import Rows, TextForward
from service.model.hybrid import HybridCache, StateUnavailable
from service.model.loading import load_model
from service.model.prompts import ChatMessage, ImagePart, TextPart

from conftest import built_preset, make_settings, prepared, transformers_model

PRESETS = ["tiny-qwen35", "tiny-qwen35-moe"]


@pytest.fixture(scope="module", params=PRESETS)
def preset_dir(request, cache_dir):
    return built_preset(cache_dir, request.param)


@pytest.fixture(scope="module")
def quantized_dirs(cache_dir, preset_dir):
    """The preset written by `python -m service quantize` (INT8) and `--bits 4`."""
    from service.quant.writer import write_quantized

    dirs = {"int8-checkpoint": cache_dir / f"{preset_dir.name}-int8", "int4": cache_dir / f"{preset_dir.name}-int4"}
    for kind, path in dirs.items():
        if not (path / "config.json").exists():
            write_quantized(preset_dir, path, progress=False, bits=4 if kind == "int4" else 8)
    return dirs


@pytest.fixture(scope="module")
def engines(cache_dir, preset_dir, quantized_dirs):
    """Engines on the preset by weights — fp32, int8 (quantized at load), "int8-checkpoint" and "int4"
    (the quantized checkpoints) — and settings."""
    made = {}

    def get(weights: str, **settings) -> Engine:
        key = (weights, tuple(sorted(settings.items())))
        if key not in made:
            loaded = next((e.loaded for k, e in made.items() if k[0] == weights), None)
            path = quantized_dirs.get(weights, preset_dir)
            quantization = "fp32" if weights == "fp32" else "int8"
            s = make_settings(cache_dir, model_path=path, quantization=quantization, int8_kernel="native", **settings)
            made[key] = Engine(loaded or load_model(s), s)
        return made[key]

    return get


WEIGHTS = pytest.mark.parametrize("weights", ["int8", "int4"])


@pytest.fixture(scope="module")
def attention():
    return ExactAttention.load()


def test_loads_as_a_hybrid_model(engines):
    model = engines("int8").model
    layers = model.model.language_model.layers
    assert [hasattr(layer, "linear_attn") for layer in layers] == [True, True, True, False]
    assert (
        not hasattr(model.model.visual, "deepstack_merger_list") or len(model.model.visual.deepstack_merger_list) == 0
    )
    cache = TextForward(model, ExactAttention.load()).new_cache(torch.float32)
    assert isinstance(cache, HybridCache) and isinstance(cache.layers[0], RecurrentLayer)


def test_the_forward_computes_what_transformers_qwen35_forward_computes(engines, attention, preset_dir):
    """A picture prompt, then 16 greedy tokens, through the service's forward and transformers'
    untouched `Qwen3_5(Moe)ForConditionalGeneration` (its torch Gated DeltaNet, its MoE block), fp32:
    the same tokens, logits within float rounding."""
    from transformers import DynamicCache

    engine = engines("fp32")
    forward = TextForward(engine.model, attention)
    model = transformers_model(preset_dir)
    parts = a_picture_and_a_question(engine)
    rows = prompt_rows(engine, parts)
    prompt = prepared(engine, GenerationRequest([ChatMessage("user", parts)]))
    ours, first = prefill(forward, rows, pieces(len(rows.ids), 24), torch.float32)
    logits, (answer,) = decode(forward, [ours], first[-1:], [rows.rope_delta], steps=16)
    reference = transformers_greedy(model, prompt, rows.rope_delta, DynamicCache(config=model.config.text_config))
    got = torch.cat([first[-1:], logits[0]])
    assert len(set(answer)) > 6  # a varied answer
    assert [int(r.argmax()) for r in got] == [int(r.argmax()) for r in reference]
    assert float((got - reference).abs().max() / reference.abs().max()) < 1e-4


# -- INT8: the same bits on every path -------------------------------------------------------------


@WEIGHTS
def test_a_prompt_in_pieces_of_any_size_gives_the_same_bits(engines, weights, attention):
    engine = engines(weights)
    forward = TextForward(engine.model, attention)
    rows = prompt_rows(engine, a_picture_and_a_question(engine))
    length = len(rows.ids)
    whole_cache, whole = prefill(forward, rows, [length], torch.float32, every_row=True)
    picture = int((rows.types == 1).nonzero()[0])
    for ends in (list(range(1, length + 1)), pieces(length, 5, 17, 3), pieces(length, picture + 7, 1, 30)):
        cache, logits = prefill(forward, rows, ends, torch.float32, every_row=True)
        assert torch.equal(logits, whole)
        assert same_kv(cache, whole_cache)


@WEIGHTS
def test_a_generated_token_gets_the_same_bits_a_later_prefill_computes_for_it(engines, weights, attention):
    engine = engines(weights)
    forward = TextForward(engine.model, attention)
    parts = a_picture_and_a_question(engine)
    rows = prompt_rows(engine, parts)
    cache, first = prefill(forward, rows, pieces(len(rows.ids), 24, 24), torch.float32)
    logits, (answer,) = decode(forward, [cache], first[-1:], [rows.rope_delta])
    again = prompt_rows(engine, parts, extra_ids=answer)
    recomputed_cache, recomputed = prefill(
        forward, again, pieces(len(again.ids), 40, 7, 13), torch.float32, every_row=True
    )
    assert same_kv(recomputed_cache, cache)
    assert torch.equal(recomputed[len(rows.ids) - 1 :], torch.cat([first[-1:], logits[0]]))


@WEIGHTS
def test_sequences_alone_and_in_a_batch_give_the_same_bits(engines, weights, attention):
    engine = engines(weights)
    forward = TextForward(engine.model, attention)
    prompts = [
        prompt_rows(engine, a_picture_and_a_question(engine)),
        prompt_rows(engine, [TextPart("Hi.")]),
        prompt_rows(engine, [TextPart("Tell me a long story about a red square and a blue circle, please.")]),
    ]
    alone = []
    for p in prompts:
        cache, first = prefill(forward, p, pieces(len(p.ids), 16), torch.float32)
        alone.append((decode(forward, [cache], first[-1:], [p.rope_delta])[0][0], cache))
    batch = [prefill(forward, p, pieces(len(p.ids), 16), torch.float32) for p in prompts]
    together, _ = decode(
        forward, [cache for cache, _ in batch], [first[-1] for _, first in batch], [p.rope_delta for p in prompts]
    )
    for (logits, cache), batched, (batched_cache, _) in zip(alone, together, batch, strict=True):
        assert torch.equal(batched, logits)
        assert same_kv(batched_cache, cache)


@WEIGHTS
def test_guesses_taken_back_leave_the_bits_of_a_run_without_them(engines, weights, attention):
    """A decode step feeds its token and four guesses (undoable rows); two are accepted: the cache
    then holds what feeding only those would leave, and the next tokens get the same bits."""
    engine = engines(weights)
    forward = TextForward(engine.model, attention)
    rows = prompt_rows(engine, [TextPart("Tell me a long story about a red square, please.")])
    cache, first = prefill(forward, rows, [len(rows.ids)], torch.float32)
    logits, (answer,) = decode(forward, [cache], first[-1:], [rows.rope_delta], steps=12)
    replay, first = prefill(forward, rows, [len(rows.ids)], torch.float32)
    start = replay.get_seq_length() + rows.rope_delta
    fed = answer[:5]
    forward(torch.tensor(fed), torch.arange(start, start + 5), [Rows(replay, 5, undoable=True)])
    replay.crop(-2)  # three of the five kept
    rest, _ = decode(forward, [replay], [logits[0][2]], [rows.rope_delta], steps=9)
    assert torch.equal(rest[0], logits[0][3:])
    with pytest.raises(StateUnavailable):  # only snapshots, the present and the last step's guesses
        replay.crop(-4)


def test_the_int8_checkpoint_answers_as_quantizing_at_load_and_the_4bit_one_is_4bit(engines, attention):
    """The INT8 checkpoint's Linears (the linear attention's fused input projection included) are the ones
    quantizing at load makes: the same logits, bit for bit; the 4-bit checkpoint's text Linears are 4-bit."""
    from service.quant.int4_linear import Int4Linear

    layer = engines("int4").model.model.language_model.layers[0]
    assert isinstance(layer.linear_attn.in_proj_qkvz, Int4Linear) and isinstance(layer.linear_attn.out_proj, Int4Linear)
    at_load, checkpoint = engines("int8"), engines("int8-checkpoint")
    rows = prompt_rows(at_load, a_picture_and_a_question(at_load))
    _, expected = prefill(TextForward(at_load.model, attention), rows, [len(rows.ids)], torch.float32, every_row=True)
    _, got = prefill(TextForward(checkpoint.model, attention), rows, [len(rows.ids)], torch.float32, every_row=True)
    assert torch.equal(got, expected)


# -- through the engine -------------------------------------------------------------------------


@WEIGHTS
def test_greedy_answers_alone_in_a_batch_and_without_speculation_are_the_same_bits(engines, weights):
    engine = engines(weights, max_batch_size=4, prefill_chunk_tokens=24, cache_enabled=False)
    makes = [
        lambda: request([TextPart("Hi.")], max_tokens=24, logprobs=3),
        lambda: request(
            [ImagePart(image(engine, 256, 256)), TextPart("What is in this picture, in detail?")], logprobs=3
        ),
        lambda: request([TextPart("Tell me a long story about a red square, please.")], max_tokens=20, logprobs=3),
    ]
    alone = [Stream(engine, dataclasses.replace(make(), speculative=False)).start().join().done for make in makes]
    streams = [Stream(engine, make()).start() for make in makes]
    together = [s.join().done for s in streams]
    assert len({tuple(d.token_ids) for d in alone}) == 3
    for a, b in zip(alone, together, strict=True):
        assert list(a.token_ids) == list(b.token_ids)
        assert a.logprobs == b.logprobs  # every log-probability and its alternatives, as floats


@WEIGHTS
def test_a_second_turn_from_the_cache_answers_the_bits_of_a_fresh_computation(engines, cache_dir, weights):
    engine = engines(weights)
    plain = make_settings(cache_dir, model_path=engine.loaded.path, int8_kernel="native", cache_enabled=False)
    pair = Engines(cached=engine, plain=Engine(engine.loaded, plain))
    picture = image(engine, 224, 160, seed=4)
    first, second = converse(pair, [user(picture, "What is in this picture?"), user("Tell me more.")], "q35-1")
    # Qwen3.5's template writes the answer back without its thinking block: the history shares the
    # first prompt up to its answer's `<think>\n` opening, where the prefill kept the state
    assert second.cached_tokens == first.prompt_tokens - 2
    # a stateless client resending its history: reused up to a snapshot of the state (a turn's start at least)
    history = [user(picture, "What is in this picture?"), assistant(first.text), user("And the colours?")]
    assert pair.ask(history).cached_tokens > 0


# The releases' parameter counts (Hugging Face's safetensors totals: vision, text and the MTP head;
# docs/models.md names the sources). 35B-A3B-e32 and -e16: 224 or 240 of each sparse layer's 256 experts
# left out — each 3 × 2048 × 512 weights and its router row of 2048 — in its 40 layers and the MTP layer.
PUBLISHED_PARAMETERS = {
    "qwen3.5-0.8b": 873_438_784,
    "qwen3.5-2b": 2_274_069_824,
    "qwen3.5-4b": 4_659_865_088,
    "qwen3.5-9b": 9_653_104_368,
    "qwen3.5-35b-a3b": 35_951_822_704,
}
for _experts in (32, 16):
    _left_out = 41 * (256 - _experts) * (3 * 2048 * 512 + 2048)
    PUBLISHED_PARAMETERS[f"qwen3.5-35b-a3b-e{_experts}"] = PUBLISHED_PARAMETERS["qwen3.5-35b-a3b"] - _left_out


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMETERS))
def test_presets_have_the_releases_parameter_counts(preset):
    """Every tensor a preset's checkpoint stores (built on the meta device: no memory), the MTP head's
    included and a tied lm_head counted once: the release's parameter count to the last digit."""
    import math

    from service.random_checkpoints.presets import model_config
    from service.random_checkpoints.random_weights import checkpoint_shapes

    shapes = checkpoint_shapes(model_config(preset))
    assert sum(math.prod(shape) for shape in shapes.values()) == PUBLISHED_PARAMETERS[preset]
    assert sum(name.startswith("mtp.") for name in shapes) >= 15


# -- published GPTQ / AWQ checkpoints -------------------------------------------------------------


def write_published(preset_dir, dst, method: str) -> dict[str, tuple]:
    """The preset as GPTQModel / AutoAWQ publish a Qwen3.5: every text Linear 4-bit (each expert its own
    Linears, as Qwen3.5-MoE's releases store them) but the small b and a projections (a row per value head:
    4 here, where both pack zero points 8 output rows to a word) and the shared expert's gate; the vision
    tower, embedding, lm_head and the MTP head left as they were. Returns each published Linear's
    (values, zeros, scales)."""
    tensors, quantized = copied_without_weights(preset_dir, dst), {}
    linears = [k for k in tensors if k.startswith("model.language_model.layers.") and "proj" in k.split(".")[-2]]
    for key in linears:
        if key.endswith(("in_proj_a.weight", "in_proj_b.weight")):
            continue
        name = key.removesuffix(".weight")
        quantized[name] = publish_linear(tensors, name, tensors.pop(key), method)
    save_published(dst, tensors, method)
    return quantized


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_published_qwen35_loads_with_exactly_its_weights_and_answers(cache_dir, preset_dir, tmp_path, method):
    """MODEL_PATH at a GPTQ or AWQ Qwen3.5: its linear attention's q/k/v and z projections hold exactly
    the published values, zero points and scales side by side (as the forward fuses them), the b and a
    projections left unquantized INT8, every expert its own; and it answers."""
    from service.quant.int4_linear import Int4Linear, pack
    from service.quant.int8_linear import Int8Linear

    src = tmp_path / method
    quantized = write_published(preset_dir, src, method)
    settings = make_settings(cache_dir, model_path=src)
    loaded = load_model(settings)
    assert loaded.quantization == "int4"
    prefix = "model.language_model.layers.0.linear_attn"
    attn = loaded.model.get_submodule(prefix)
    parts = [quantized[f"{prefix}.{p}"] for p in ("in_proj_qkv", "in_proj_z")]
    assert isinstance(attn.in_proj_qkvz, Int4Linear)
    for name, tensor in pack(*[torch.cat([part[i] for part in parts]) for i in range(3)]).items():
        assert torch.equal(getattr(attn.in_proj_qkvz, name), tensor), name
    assert isinstance(attn.in_proj_ba, Int8Linear)
    mlp = loaded.model.model.language_model.layers[0].mlp
    if hasattr(mlp, "experts"):
        assert all(isinstance(m, Int4Linear) for m in [*mlp.experts.gate_up, *mlp.experts.down])
    assert greedy(Engine(loaded, settings), "Hello there.").completion_tokens == 16


# -- the disk tier: keys and values, and the recurrent states ---------------------------------------


@WEIGHTS
def test_a_second_turn_from_disk_has_the_bits_of_one_from_memory_and_of_a_recompute(
    engines, cache_dir, tmp_path, weights
):
    """A conversation's first turn kept on disk — its attention layers' blocks and its recurrent states
    (where its turns start and end) — and the store copied as a restart finds it: the second turn on
    another engine resumes from disk, where memory resumed, with the same bits as from memory and as a
    recompute."""
    import shutil

    from test_kv_disk import QUESTION

    from service.caches.kv_disk import BLOCK_TOKENS

    loaded = engines(weights).loaded

    def tiered(folder, **settings) -> Engine:
        quantization = "fp32" if weights == "fp32" else "int8"
        s = make_settings(cache_dir, model_path=loaded.path, quantization=quantization, kv_disk_dir=folder, **settings)
        return Engine(loaded, s)

    first = tiered(tmp_path / "kv")
    history = [user(image(first, seed=5), QUESTION)]
    _, done = turn(first, history, "A")
    assert first.caches.kv.disk.flush(30)
    assert list((tmp_path / "kv").rglob("*.state"))  # the states, beside the blocks
    follow = history + [assistant(done.text), user("Tell me more.")]
    shutil.copytree(tmp_path / "kv", tmp_path / "copy")
    memory_ids, from_memory = turn(first, follow, "A")
    disk_ids, from_disk = turn(tiered(tmp_path / "copy"), follow, "A")
    plain_ids, plain = turn(tiered(tmp_path / "off", cache_enabled=False), follow)
    assert (from_memory.cached_from, from_disk.cached_from, plain.cached_from) == ("memory", "disk", None)
    assert from_disk.cached_tokens == from_memory.cached_tokens >= BLOCK_TOKENS
    assert disk_ids == memory_ids == plain_ids
    assert from_disk.logprobs == from_memory.logprobs == plain.logprobs


@pytest.mark.parametrize("change", ["missing", "unknown"])
def test_a_checkpoint_with_a_missing_or_unknown_tensor_is_refused_by_name(cache_dir, preset_dir, tmp_path, change):
    import shutil

    from safetensors.torch import load_file, save_file

    copy = tmp_path / "broken"
    shutil.copytree(preset_dir, copy)
    tensors = load_file(copy / "model.safetensors")
    name = "model.language_model.layers.0.linear_attn.A_log"
    if change == "missing":
        del tensors[name]
    else:
        name = "model.language_model.layers.0.linear_attn.mystery.weight"
        tensors[name] = torch.zeros(4)
    save_file(tensors, copy / "model.safetensors")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_model(make_settings(cache_dir, model_path=copy, quantization="fp32"))


@WEIGHTS
def test_a_paused_answer_has_the_bits_of_one_never_paused(engines, weights):
    """A full batch of one: a less urgent answer pauses (its recurrent states and keys kept as they are)
    while an urgent one runs, then resumes — the same tokens and log-probabilities as never paused."""
    from test_priorities import background_request, preempted_run, run, same_bits, urgent_request

    engine = engines(weights, max_batch_size=1, queue_size=4, prefill_chunk_tokens=24, cache_enabled=False)
    expected = run(engine, background_request(engine, "greedy"))
    low, urgent, seen = preempted_run(engine, background_request(engine, "greedy"))
    assert low.preempted == 1 and "paused" in seen
    assert same_bits(low, expected) and same_bits(urgent, run(engine, urgent_request()))
