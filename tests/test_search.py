"""Search on the tiny presets, in process: Qwen3-VL-Embedding's vectors and Qwen3-VL-Reranker's scores
have the same bits alone, beside other inputs, cut in pieces and with their shared head from the cache
(INT8 and 4-bit); fp32 matches the official reading — transformers' Qwen3-VL backbone with the official
pooling — within float rounding; the releases' shapes; how a checkpoint's task is told; what is refused."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from service import metrics
from service.engine.engine import Engine
from service.engine.search import SearchRequest, last_token_vector
from service.engine.search_reference import official_embedding, official_score, reference_model
from service.errors import BadRequest, ServiceError
from service.generation import GenerationRequest
from service.media.images import decode_image
from service.model.loading import load_model
from service.model.prompts import ChatMessage, ImagePart, TextPart, prepare_prompt
from service.model.search_prompts import embedding_instruction, embedding_prompt, rerank_prompt
from service.model.task import checkpoint_task
from service.random_checkpoints.presets import model_config, preset_of
from service.random_checkpoints.random_weights import checkpoint_shapes

from conftest import built_preset, make_settings
from imaging import pattern

TEXTS = [
    "a red car",
    "the cat sat on the mat beside a blue door and a green tree",
    "where is the dog?",
    "sky " * 40,
    "one",
]


@pytest.fixture(scope="module")
def embedding_dir(cache_dir):
    return built_preset(cache_dir, "tiny-embedding")


@pytest.fixture(scope="module")
def reranker_dir(cache_dir):
    return built_preset(cache_dir, "tiny-reranker")


def _quantized(source, cache_dir, bits: int):
    from service.quant.writer import write_quantized

    path = cache_dir / f"{source.name}-int{bits}"
    if not (path / "config.json").exists():
        write_quantized(source, path, progress=False, bits=bits)
    return path


def _engine(cache_dir, path, weights: str, **overrides) -> Engine:
    """An engine on `path` with `weights` (fp32, int8 quantized at load, int4 the 4-bit copy)."""
    if weights == "int4":
        path = _quantized(path, cache_dir, 4)
        overrides["model_task"] = "embedding" if "embedding" in path.name else "rerank"
    settings = make_settings(
        cache_dir, model_path=path, quantization="fp32" if weights == "fp32" else "int8", **overrides
    )
    return Engine(load_model(settings), settings)


def _picture(seed: int):
    from imaging import encode

    return decode_image(encode(pattern(64, 48, seed=seed), ".png"), make_settings_limits())


def make_settings_limits():
    from service.media.images import ImageLimits

    return ImageLimits(max_pixels=64 * 64, max_bytes=1 << 20, max_decoded_pixels=1 << 22, factor=32)


def _inputs():
    """Texts, a picture, a picture with a caption, an instruction of its own."""
    prompts = [embedding_prompt([TextPart(t)], None) for t in TEXTS]
    prompts.append(embedding_prompt([ImagePart(_picture(1))], None))
    prompts.append(embedding_prompt([ImagePart(_picture(2)), TextPart("a caption")], None))
    prompts.append(embedding_prompt([TextPart("find the cat")], "Retrieve pictures of the query"))
    return prompts


def _embed(engine, prompts, **kw):
    request = SearchRequest("embedding", prompts, time.perf_counter(), **kw)
    return engine.run_search(request)


def _rerank(engine, query, documents, **kw):
    prompts = [rerank_prompt(query, d, None) for d in documents]
    return engine.run_search(SearchRequest("rerank", prompts, time.perf_counter(), item_param="documents", **kw))


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_vector_has_the_same_bits_alone_batched_in_pieces_and_from_the_cache(cache_dir, embedding_dir, weights):
    engine = _engine(cache_dir, embedding_dir, weights)
    prompts = _inputs()
    alone = [_embed(engine, [p], cache_namespace=f"fresh-{i}").vectors[0] for i, p in enumerate(prompts)]
    together = _embed(engine, prompts, cache_namespace="together")
    assert together.shared_tokens > 0  # the instruction's head computed once for all of them
    from_cache = _embed(engine, prompts[::-1], cache_namespace="together").vectors[::-1]
    pieces = _engine(cache_dir, embedding_dir, weights, search_batch_tokens=16)
    in_pieces = _embed(pieces, prompts, cache_namespace="pieces").vectors
    for i, vector in enumerate(alone):
        assert torch.equal(vector, together.vectors[i]), i
        assert torch.equal(vector, from_cache[i]), i
        assert torch.equal(vector, in_pieces[i]), i
        assert abs(float(vector.norm()) - 1) < 1e-6
    assert not torch.equal(alone[0], alone[1])


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_score_is_the_same_float_alone_batched_in_pieces_and_from_the_cache(cache_dir, reranker_dir, weights):
    engine = _engine(cache_dir, reranker_dir, weights)
    query = [TextPart("a cat on a red car")]
    documents = [[TextPart(t)] for t in TEXTS] + [[ImagePart(_picture(3))], [ImagePart(_picture(4)), TextPart("x")]]
    together = _rerank(engine, query, documents, cache_namespace="together")
    alone = [_rerank(engine, query, [d], cache_namespace=f"fresh-{i}").scores[0] for i, d in enumerate(documents)]
    again = _rerank(engine, query, documents[::-1], cache_namespace="together").scores[::-1]
    pieces = _engine(cache_dir, reranker_dir, weights, search_batch_tokens=16)
    in_pieces = _rerank(pieces, query, documents, cache_namespace="pieces").scores
    assert together.scores == alone == again == in_pieces
    assert all(0 < s < 1 for s in alone) and len(set(alone)) > 1
    picture_query = _rerank(engine, [ImagePart(_picture(5)), TextPart("this")], documents[:3])
    lone = [_rerank(engine, [ImagePart(_picture(5)), TextPart("this")], [d]).scores[0] for d in documents[:3]]
    assert picture_query.scores == lone
    assert picture_query.shared_tokens > 3 * together.shared_tokens // len(documents)  # the query's picture shared


def test_fp32_vectors_match_the_official_reading_on_transformers_backbone(cache_dir, embedding_dir):
    engine = _engine(cache_dir, embedding_dir, "fp32", kv_dtype="float32")
    reference = reference_model(embedding_dir)
    prompts = _inputs()
    ours = _embed(engine, prompts).vectors
    for prompt, vector in zip(prompts, ours):
        prepared = prepare_prompt(engine.processor, prompt.messages, engine.limits.prompt)
        assert float(torch.dot(vector, official_embedding(reference, prepared))) > 1 - 1e-5


def test_fp32_scores_match_the_official_reading_on_transformers_backbone(cache_dir, reranker_dir):
    engine = _engine(cache_dir, reranker_dir, "fp32", kv_dtype="float32")
    reference = reference_model(reranker_dir)
    vocab = engine.processor.tokenizer.get_vocab()
    query = [TextPart("a cat")]
    documents = [[TextPart(t)] for t in TEXTS] + [[ImagePart(_picture(6))]]
    ours = _rerank(engine, query, documents).scores
    for document, score in zip(documents, ours):
        prepared = prepare_prompt(engine.processor, rerank_prompt(query, document, None).messages, engine.limits.prompt)
        assert abs(score - official_score(reference, prepared, vocab["yes"], vocab["no"])) < 1e-5


def test_the_prompts_are_written_as_the_official_code_writes_them(cache_dir, embedding_dir):
    engine = _engine(cache_dir, embedding_dir, "int8")
    text = engine.processor.apply_chat_template(
        [
            {"role": "system", "content": [{"type": "text", "text": "Represent the user's input."}]},
            {"role": "user", "content": [{"type": "text", "text": "hello"}]},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    ours = prepare_prompt(engine.processor, embedding_prompt([TextPart("hello")], None).messages, engine.limits.prompt)
    assert ours.text == text
    assert embedding_instruction("Find the cat") == "Find the cat."
    assert (
        embedding_instruction(" Find it? ") == "Find it?" and embedding_instruction("") == "Represent the user's input."
    )
    pair = rerank_prompt([TextPart("q")], [TextPart("d")], None)
    rendered = prepare_prompt(engine.processor, pair.messages, engine.limits.prompt).text
    assert rendered.endswith(
        "<|im_start|>user\n<Instruct>: Given a search query, retrieve relevant candidates that answer the query."
        "<Query>:q\n<Document>:d<|im_end|>\n<|im_start|>assistant\n"
    )
    assert 'Note that the answer can only be "yes" or "no".<|im_end|>' in rendered


def test_matryoshka_keeps_the_leading_values_renormalised():
    hidden = torch.randn(256)
    vector = last_token_vector(hidden, 64)
    assert vector.shape == (64,) and abs(float(vector.norm()) - 1) < 1e-6
    assert torch.allclose(vector, F.normalize(hidden[:64], dim=0), atol=1e-7)


# The releases' parameter counts: the chat model's (docs/models.md) for the reranker, whose files hold it
# all; Qwen3-VL-Embedding-8B's files hold no lm_head (QwenLM/Qwen3-VL-Embedding#89): 8B's count less
# 151936 × 4096.
SEARCH_PARAMETERS = {
    "2b-embedding": 2_127_532_032,
    "2b-reranker": 2_127_532_032,
    "8b-embedding": 8_767_123_696 - 151_936 * 4096,
    "8b-reranker": 8_767_123_696,
}


@pytest.mark.parametrize("preset", sorted(SEARCH_PARAMETERS))
def test_search_presets_store_the_releases_tensors(preset):
    config = model_config(preset)
    shapes = checkpoint_shapes(config)
    if preset_of(preset).headless:
        shapes.pop("lm_head.weight")
    count = sum(torch.Size(s).numel() for s in shapes.values())
    assert count == SEARCH_PARAMETERS[preset]
    assert config.text_config.tie_word_embeddings == preset.startswith("2b")


def test_the_task_is_told_by_model_task_a_missing_head_or_the_name(tmp_path, tiny_dir):
    config = model_config("8b-embedding")
    headless = tmp_path / "renamed"
    headless.mkdir()
    names = {"model.language_model.embed_tokens.weight": "a.safetensors", "model.norm.weight": "a.safetensors"}
    (headless / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    assert checkpoint_task("auto", headless, "renamed", config) == "embedding"
    with_head = tmp_path / "with-head"
    with_head.mkdir()
    names["lm_head.weight"] = "a.safetensors"
    (with_head / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    assert checkpoint_task("auto", with_head, "Qwen3-VL-Reranker-8B", config) == "rerank"
    assert checkpoint_task("auto", with_head, "my-model", config) == "chat"
    assert checkpoint_task("rerank", with_head, "my-model", config) == "rerank"
    tied = model_config("2b")
    assert checkpoint_task("auto", tiny_dir, "Qwen3-VL-Embedding-2B", tied) == "embedding"


def test_an_embedding_model_refuses_chat_and_a_chat_model_refuses_search(cache_dir, embedding_dir, loaded_model):
    engine = _engine(cache_dir, embedding_dir, "int8")
    chat = GenerationRequest(messages=[ChatMessage("user", [TextPart("hi")])])
    with pytest.raises(BadRequest) as refused:
        engine.submit(chat)
    assert refused.value.code == "wrong_model_task" and "/v1/embeddings" in refused.value.message
    with pytest.raises(BadRequest) as wrong:
        _rerank(engine, [TextPart("q")], [[TextPart("d")]])
    assert wrong.value.code == "wrong_model_task"
    chat_engine = Engine(loaded_model("int8"), make_settings(cache_dir))
    with pytest.raises(BadRequest) as not_search:
        _embed(chat_engine, [embedding_prompt([TextPart("x")], None)])
    assert "/v1/chat/completions" in not_search.value.message


def test_bad_search_requests_are_refused_naming_the_field(cache_dir, embedding_dir):
    engine = _engine(cache_dir, embedding_dir, "int8", search_max_items=3)
    one = embedding_prompt([TextPart("x")], None)
    with pytest.raises(BadRequest) as empty:
        _embed(engine, [])
    assert empty.value.param == "input"
    with pytest.raises(BadRequest) as many:
        _embed(engine, [one] * 4)
    assert many.value.param == "input" and many.value.code == "too_many_items"
    for dimensions in (63, 65):
        with pytest.raises(BadRequest) as bad:
            _embed(engine, [one], dimensions=dimensions)
        assert bad.value.param == "dimensions"
    assert _embed(engine, [one], dimensions=64).vectors[0].shape == (64,)
    long = embedding_prompt([TextPart("word " * 20000)], None)
    with pytest.raises(ServiceError) as too_long:
        _embed(engine, [one, long])
    assert too_long.value.param == "input[1]"


def test_fp32_vectors_are_the_same_bits_alone_and_together(cache_dir, embedding_dir):
    """fp32 weights too: their Linears are the fixed-order GEMMs (every output one chain of multiply-adds
    over its inputs in order), so a row no longer rounds by how many share the call."""
    engine = _engine(cache_dir, embedding_dir, "fp32")
    prompts = _inputs()
    together = _embed(engine, prompts, cache_namespace="fp32-together").vectors
    alone = [_embed(engine, [p], cache_namespace=f"fp32-alone-{i}").vectors[0] for i, p in enumerate(prompts)]
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


def test_a_search_paused_for_a_more_urgent_one_resumes_with_the_same_bits(cache_dir, embedding_dir):
    """One place in the batch: a background request of many inputs, a few rows a forward, gives its place
    to an urgent one at its next forward and resumes: its vectors are the bits of a run never paused, and
    the paused gauge is back where it was."""
    from service.engine.search import SearchJob
    from service.engine.sequence import Status
    from service.generation import priority_class

    engine = _engine(cache_dir, embedding_dir, "int8", max_batch_size=1, search_batch_tokens=16)
    prompts = _inputs() + [embedding_prompt([TextPart(f"note {i}: " + "word " * 30)], None) for i in range(24)]
    expected = _embed(engine, prompts, cache_namespace="never-paused").vectors
    preemptions, paused = (m.labels(priority_class(5)) for m in (metrics.PREEMPTIONS, metrics.PAUSED))
    before, gauge = preemptions._value.get(), paused._value.get()
    out = {}
    low = threading.Thread(target=lambda: out.update(low=_embed(engine, prompts, priority=5, cache_namespace="low")))
    low.start()
    deadline = time.monotonic() + 30
    while not any(isinstance(j, SearchJob) and j.status is Status.PREFILLING for j in engine.scheduler._waiting):
        assert time.monotonic() < deadline and low.is_alive(), "the background request never started"
        time.sleep(0.001)
    urgent = _embed(engine, prompts[:1], priority=-1, cache_namespace="urgent").vectors[0]
    low.join()
    assert preemptions._value.get() == before + 1 and paused._value.get() == gauge
    assert all(torch.equal(a, b) for a, b in zip(out["low"].vectors, expected, strict=True))
    assert torch.equal(urgent, expected[0])


def test_pictures_go_through_the_vision_cache(cache_dir, embedding_dir):
    engine = _engine(cache_dir, embedding_dir, "int8")
    hits = metrics.CACHE_HITS.labels(cache="vision")
    prompt = embedding_prompt([ImagePart(_picture(7))], None)
    first = _embed(engine, [prompt], cache_namespace="pictures").vectors[0]
    before = hits._value.get()
    again = _embed(engine, [prompt, embedding_prompt([TextPart("x")], None)], cache_namespace="pictures").vectors[0]
    assert hits._value.get() == before + 1 and torch.equal(first, again)


def test_mapped_4_bit_weights_embed_with_the_same_bits(cache_dir, embedding_dir):
    """Over the memory budget a 4-bit checkpoint is served from the mapped file, by the same kernel."""
    path = _quantized(embedding_dir, cache_dir, 4)
    mapped = load_model(make_settings(cache_dir, model_path=path, model_task="embedding", max_memory_mb=1))
    assert mapped.weights_mapped and mapped.task == "embedding"
    engine = Engine(mapped, make_settings(cache_dir, model_path=path, model_task="embedding"))
    prompts = _inputs()
    in_memory = _embed(_engine(cache_dir, embedding_dir, "int4"), prompts).vectors
    assert all(torch.equal(a, b) for a, b in zip(_embed(engine, prompts).vectors, in_memory))


def test_compare_search_reports_the_official_reading_on_a_checkpoint(cache_dir, embedding_dir, reranker_dir):
    from conftest import run_cli

    for path, unit in ((embedding_dir, "1 - cosine"), (reranker_dir, "|score difference|")):
        done = run_cli("compare-search", str(path), "--cache-dir", str(cache_dir), timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        worst = next(line for line in done.stdout.splitlines() if line.startswith("worst:"))
        assert unit in worst and float(worst.split("= ")[1].split()[0]) < 1e-5
