"""The mixture-of-experts forward (service/model/moe.py) on `tiny-moe`: 8 experts, the top 4 per
token, a dense layer among the sparse ones, an untied embedding, written as the releases store it.

It computes what transformers' Qwen3-VL-MoE forward computes (fp32, within float rounding, the same
greedy tokens), and with INT8 or 4-bit experts a token gets the same bits whichever path computes it —
a prompt in one piece or in pieces, decoded or recomputed, alone or in a batch, beside another's
prefill piece — and through the engine a greedy answer's every log-probability is the same alone, in
a batch and after a cache hit. Its INT8 checkpoint answers as quantizing at load, bit for bit. The
router's own kernel gives a row the same bits in any call, built for this CPU or for AVX2.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_batching import Stream, request
from test_caches import Engines, assistant, converse, image, user
from test_forward import (
    a_picture_and_a_question,
    assert_a_piece_beside_decode_rows_is_exact,
    assert_as_close_as_int8_allows,
    decode,
    distance,
    pieces,
    prefill,
    prompt_rows,
    same_kv,
    transformers_greedy,
)
from test_int4 import copied_without_weights, greedy, publish_linear, save_published

from service.engine.engine import Engine, GenerationRequest
from service.model.attention import ExactAttention
from service.model.forward import TextForward
from service.model.loading import load_model
from service.model.moe import MixtureOfExperts, router_logits
from service.model.prompts import ChatMessage, ImagePart, TextPart
from service.model.skeleton import Experts
from service.quant import published
from service.quant.int4_linear import Int4Linear, pack
from service.quant.int8_linear import Int8Embedding, Int8Linear

from conftest import in_a_mapping_of, make_settings, prepared, transformers_model

# the quick tier: the service's own INT8 kernel and the 4-bit one; the whole suite FBGEMM's too
KERNELS = pytest.mark.parametrize(
    "kernel",
    ["native", pytest.param("fbgemm", marks=pytest.mark.slow), "int4"],
    ids=["int8-native", "int8-fbgemm", "int4"],
)


@pytest.fixture(scope="module")
def quantized_dirs(cache_dir, tiny_moe_dir):
    """tiny-moe written by `python -m service quantize` (INT8) and `--bits 4` (every expert 4-bit)."""
    from service.quant.writer import write_quantized

    dirs = {"int8-checkpoint": cache_dir / "tiny-moe-int8", "int4": cache_dir / "tiny-moe-int4"}
    for kind, path in dirs.items():
        if not (path / "config.json").exists():
            write_quantized(tiny_moe_dir, path, progress=False, bits=4 if kind == "int4" else 8)
    return dirs


@pytest.fixture(scope="module")
def engines(cache_dir, tiny_moe_dir, quantized_dirs):
    """Engines on tiny-moe by weights — fp32, int8 (quantized at load), "int8-checkpoint" and "int4"
    (the quantized checkpoints) — and INT8 kernel."""
    made = {}

    def get(weights: str, kernel: str = "native", **settings) -> Engine:
        key = (weights, kernel, tuple(sorted(settings.items())))
        if key not in made:
            loaded = next((e.loaded for k, e in made.items() if k[:2] == key[:2]), None)
            path = quantized_dirs.get(weights, tiny_moe_dir)
            quantization = "fp32" if weights == "fp32" else "int8"
            s = make_settings(cache_dir, model_path=path, quantization=quantization, int8_kernel=kernel, **settings)
            made[key] = Engine(loaded or load_model(s), s)
        return made[key]

    return get


def exact_engine(engines, kernel: str) -> Engine:
    """INT8 experts on `kernel`, or ("int4") the 4-bit checkpoint's."""
    return engines("int4") if kernel == "int4" else engines("int8", kernel)


@pytest.fixture(scope="module")
def attention():
    return ExactAttention.load()


def test_loads_as_a_mixture_of_experts_with_int8_experts_and_its_own_embedding(engines, tiny_moe_dir):
    from safetensors import safe_open

    model = engines("int8").model
    layers = model.model.language_model.layers
    sparse, dense = layers[0].mlp, layers[1].mlp
    assert isinstance(sparse.experts, Experts) and len(sparse.experts.gate_up) == 8
    assert all(isinstance(m, Int8Linear) for m in [*sparse.experts.gate_up, *sparse.experts.down])
    assert sparse.experts.gate_up[0].out_features == 2 * 96 and sparse.experts.down[0].in_features == 96
    assert sparse.gate.weight.dtype == torch.float32  # the router stays a float matrix
    assert isinstance(dense.gate_up_proj, Int8Linear)  # mlp_only_layers: a dense MLP beside the experts
    embedding = model.model.language_model.embed_tokens
    assert isinstance(embedding, Int8Embedding) and isinstance(model.lm_head, Int8Linear)
    with safe_open(tiny_moe_dir / "model.safetensors", "pt") as f:
        table, head = f.get_tensor("model.language_model.embed_tokens.weight"), f.get_tensor("lm_head.weight")
    assert not torch.equal(table, head)  # untied: the embedding is its own table, not lm_head's int8 rows
    ids = torch.arange(len(table))
    step = table.abs().amax(-1, keepdim=True) / 127  # one INT8 step of each row
    assert bool(((embedding(ids) - table).abs() <= step / 2 + 1e-6).all())


def test_tokens_choose_different_experts(engines, attention, monkeypatch):
    """Different tokens go to different experts: the grouping below is exercised, not one expert."""
    engine = engines("int8")
    chosen = []
    route = MixtureOfExperts.route

    def recording(self, h):
        weights, experts, shared = route(self, h)
        chosen.append(experts)
        return weights, experts, shared

    monkeypatch.setattr(MixtureOfExperts, "route", recording)
    rows = prompt_rows(engine, a_picture_and_a_question(engine))
    prefill(TextForward(engine.model, attention), rows, [len(rows.ids)], torch.float32)
    experts = torch.cat(chosen)
    assert len(chosen) == 2  # layers 0 and 2 (layer 1 is dense)
    assert len(experts.unique()) == 8
    assert len({tuple(sorted(row.tolist())) for row in experts}) > 10


@pytest.mark.parametrize("quantization", ["fp32", "int8"])
def test_the_forward_computes_what_transformers_moe_forward_computes(engines, attention, tiny_moe_dir, quantization):
    """A picture prompt, then 16 greedy tokens, through the service's forward and transformers' (fed the
    service's tokens) — fp32: the untouched `Qwen3VLMoeForConditionalGeneration` from the checkpoint (its
    own router and experts forward): the same tokens, logits within float rounding; int8: transformers'
    forward over the same INT8 Linears, whose float operations round otherwise than the service's (the
    same bits on every CPU): as close as INT8 itself allows (test_forward's rule)."""
    engine = engines(quantization)
    forward = TextForward(engine.model, attention)
    model = transformers_model(tiny_moe_dir, quantization)
    if quantization == "fp32":
        assert type(model.model.language_model.layers[0].mlp.experts).__name__ == "Qwen3VLMoeTextExperts"
    parts = a_picture_and_a_question(engine)
    rows = prompt_rows(engine, parts)
    prompt = prepared(engine, GenerationRequest([ChatMessage("user", parts)]))
    ours, first = prefill(forward, rows, pieces(len(rows.ids), 24), torch.float32)
    logits, (answer,) = decode(forward, [ours], first[-1:], [rows.rope_delta], steps=16)
    reference = transformers_greedy(model, prompt, rows.rope_delta, forward.new_cache(torch.float32), fed=answer)
    got = torch.cat([first[-1:], logits[0]])
    assert len(set(answer)) > 8  # a varied answer
    if quantization == "fp32":
        assert [int(r.argmax()) for r in got] == [int(r.argmax()) for r in reference]
        assert float(distance(got, reference).max()) < 1e-5
    else:
        fp32, cache = transformers_model(tiny_moe_dir, "fp32"), forward.new_cache(torch.float32)
        fp32_reference = transformers_greedy(fp32, prompt, rows.rope_delta, cache, fed=answer)
        assert_as_close_as_int8_allows(got, reference, fp32_reference)


def test_quantized_checkpoints_hold_the_experts_and_answer_as_quantizing_at_load(engines, attention):
    """The INT8 checkpoint's experts are the same Int8Linears quantizing at load makes (the same logits,
    bit for bit); the 4-bit one's are Int4Linears, gate/up and down (groups of 64 and 32 inputs)."""
    from service.quant.int4_linear import Int4Linear

    experts = engines("int4").model.model.language_model.layers[2].mlp.experts
    assert all(isinstance(m, Int4Linear) for m in [*experts.gate_up, *experts.down])
    assert (experts.gate_up[0].group, experts.down[0].group) == (64, 32)
    at_load, checkpoint = engines("int8"), engines("int8-checkpoint")
    rows = prompt_rows(at_load, a_picture_and_a_question(at_load))
    _, expected = prefill(TextForward(at_load.model, attention), rows, [len(rows.ids)], torch.float32, every_row=True)
    _, got = prefill(TextForward(checkpoint.model, attention), rows, [len(rows.ids)], torch.float32, every_row=True)
    assert torch.equal(got, expected)


# -- INT8 and 4-bit experts: the same bits on every path -----------------------------------------


@KERNELS
def test_a_prompt_in_pieces_of_any_size_gives_the_same_bits(engines, attention, kernel):
    engine = exact_engine(engines, kernel)
    forward = TextForward(engine.model, attention)
    rows = prompt_rows(engine, a_picture_and_a_question(engine))
    length = len(rows.ids)
    whole_cache, whole = prefill(forward, rows, [length], torch.float32, every_row=True)
    picture = int((rows.types == 1).nonzero()[0])
    for ends in (list(range(1, length + 1)), pieces(length, 5, 17, 3), pieces(length, picture + 7, 1, 30)):
        cache, logits = prefill(forward, rows, ends, torch.float32, every_row=True)
        assert torch.equal(logits, whole)
        assert same_kv(cache, whole_cache)


@KERNELS
def test_a_generated_token_gets_the_same_bits_a_later_prefill_computes_for_it(engines, attention, kernel):
    engine = exact_engine(engines, kernel)
    forward = TextForward(engine.model, attention)
    parts = a_picture_and_a_question(engine)
    rows = prompt_rows(engine, parts)
    cache, first = prefill(forward, rows, pieces(len(rows.ids), 24, 24), torch.float32)
    first = first[-1:]
    logits, (answer,) = decode(forward, [cache], first, [rows.rope_delta])
    assert len(set(answer)) > 8
    again = prompt_rows(engine, parts, extra_ids=answer)
    recomputed_cache, recomputed = prefill(
        forward, again, pieces(len(again.ids), 40, 7, 13), torch.float32, every_row=True
    )
    assert same_kv(recomputed_cache, cache)
    assert torch.equal(recomputed[len(rows.ids) - 1 :], torch.cat([first, logits[0]]))


@KERNELS
def test_sequences_alone_and_in_a_batch_of_four_give_the_same_bits(engines, attention, kernel):
    engine = exact_engine(engines, kernel)
    forward = TextForward(engine.model, attention)
    prompts = [
        prompt_rows(engine, a_picture_and_a_question(engine)),
        prompt_rows(engine, [TextPart("Hi.")]),
        prompt_rows(engine, [ImagePart(image(engine, 128, 256, seed=7)), TextPart("And this one?")]),
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


@KERNELS
def test_a_prefill_piece_beside_decode_rows_gives_each_the_same_bits(engines, attention, kernel):
    engine = exact_engine(engines, kernel)
    forward = TextForward(engine.model, attention)
    assert_a_piece_beside_decode_rows_is_exact(engine, forward, torch.float32)


# -- the router's kernel --------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [64, 2048, 2053])  # tiny-moe's, 30B-A3B's, one that leaves a tail
def test_the_router_gives_a_row_the_same_bits_in_any_call_and_on_avx2(hidden):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, hidden, generator=generator) * 3
    weight = torch.randn(128, hidden, generator=generator) * 0.02
    together = router_logits(x, weight)
    alone = torch.cat([router_logits(x[i : i + 1], weight) for i in range(len(x))])
    assert torch.equal(together, alone)
    assert torch.equal(router_logits(x[5:11], weight), together[5:11])
    assert torch.equal(router_logits(x, weight, march="x86-64-v3"), together)  # AVX2: the same lanes
    fallback = router_logits(x, weight, march="fallback")  # no compiler: exact too, in its own order
    assert torch.equal(fallback[3:4], router_logits(x[3:4], weight, march="fallback"))
    reference = x.double() @ weight.double().T
    assert float((together - reference).abs().max() / reference.abs().max()) < 1e-5


def test_the_comparison_catches_a_float_gemm_router():
    """The control: the router as a float GEMM (what transformers runs) gives a row other bits in a
    call of 300 rows than alone (measured here with MKL; a near tie would choose other experts)."""
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(300, 2048, generator=generator), torch.randn(128, 2048, generator=generator) * 0.02
    together = torch.nn.functional.linear(x, weight)
    alone = torch.cat([torch.nn.functional.linear(x[i : i + 1], weight) for i in range(len(x))])
    assert not torch.equal(together, alone)


# -- the 4-bit experts' one call per layer ----------------------------------------------------------


def four_bit_moe(experts=16, hidden=256, width=192, top_k=4, seed=0) -> MixtureOfExperts:
    """A layer of 4-bit experts (groups of 128 into gate/up, 64 into down) and a float router."""
    generator = torch.Generator().manual_seed(seed)

    def linear(n, k, group):
        weight = torch.nn.Linear(k, n, bias=False)
        weight.weight.data = torch.randn(n, k, generator=generator) * 0.05
        return Int4Linear.from_float(weight, group)

    gate = SimpleNamespace(weight=torch.randn(experts, hidden, generator=generator), top_k=top_k, norm_topk_prob=True)
    layer = SimpleNamespace(
        gate_up=[linear(2 * width, hidden, 128) for _ in range(experts)],
        down=[linear(hidden, width, 64) for _ in range(experts)],
        act_fn=torch.nn.functional.silu,
    )
    return MixtureOfExperts(SimpleNamespace(gate=gate, experts=layer))


def test_4bit_experts_run_in_one_call_that_computes_one_call_per_expert():
    """`int4_experts` (one native call per layer) against the experts called one by one in Python:
    the same sums within silu's rounding (its expf, not torch's); each row the same bits alone, in
    the call, in another order, and when 300 rows share one expert (several row blocks of it)."""
    moe = four_bit_moe()
    assert moe.int4 is not None
    h = torch.randn(300, 256, generator=torch.Generator().manual_seed(1))
    one_call = moe(h)
    kernel, moe.int4 = moe.int4, None
    per_expert = moe(h)
    moe.int4 = kernel
    assert float((one_call - per_expert).abs().max() / per_expert.abs().max()) < 1e-5
    assert torch.equal(torch.cat([moe(h[i : i + 1]) for i in range(0, 300, 7)]), one_call[::7])
    order = torch.randperm(300, generator=torch.Generator().manual_seed(2))
    assert torch.equal(moe(h[order]), one_call[order])
    weights, chosen, _ = moe.route(h)
    # every row's first choice expert 3 (a row that chose 3 later gets its own first choice there)
    crowded = torch.where(chosen == 3, chosen[:, :1], chosen)
    crowded[:, 0] = 3
    together = kernel(h, weights, crowded)
    assert torch.equal(torch.cat([kernel(h[i : i + 1], weights[i : i + 1], crowded[i : i + 1]) for i in (0, 150, 299)]),
                       together[[0, 150, 299]])  # fmt: skip
    with pytest.raises(ValueError, match="expert number"):
        kernel(h[:1], weights[:1], torch.full_like(chosen[:1], 16))


# -- through the engine ------------------------------------------------------------------------


WEIGHTS = pytest.mark.parametrize("weights", ["int8", "int4"])


@WEIGHTS
def test_greedy_answers_alone_and_in_a_batch_are_the_same_bits(engines, weights):
    engine = engines(weights, max_batch_size=4, prefill_chunk_tokens=24, cache_enabled=False)
    requests = [
        lambda: request([TextPart("Hi.")], max_tokens=24, logprobs=3),
        lambda: request(
            [ImagePart(image(engine, 256, 256)), TextPart("What is in this picture, in detail?")], logprobs=3
        ),
        lambda: request([TextPart("Tell me a long story about a red square, please.")], max_tokens=20, logprobs=3),
        lambda: request([ImagePart(image(engine, 128, 128, seed=2)), TextPart("And this one?")], logprobs=3),
    ]
    alone = [Stream(engine, make()).start().join().done for make in requests]
    streams = [Stream(engine, make()).start() for make in requests]
    together = [s.join().done for s in streams]
    assert len({tuple(d.token_ids) for d in alone}) == 4
    for a, b in zip(alone, together, strict=True):
        assert list(a.token_ids) == list(b.token_ids)
        assert a.logprobs == b.logprobs  # every log-probability and its alternatives, as floats


@WEIGHTS
def test_a_cache_hit_answers_the_bits_of_a_fresh_computation(engines, cache_dir, weights):
    engine = engines(weights)
    plain = make_settings(cache_dir, model_path=engine.loaded.path, int8_kernel="native", cache_enabled=False)
    pair = Engines(cached=engine, plain=Engine(engine.loaded, plain))
    picture = image(engine, 224, 160, seed=4)
    first, second = converse(pair, [user(picture, "What is in this picture?"), user("Tell me more.")], "moe-1")
    assert second.cached_tokens >= first.prompt_tokens - 1
    # a stateless client resending the history (its answer re-rendered as text) hits by prefix
    history = [user(picture, "What is in this picture?"), assistant(first.text), user("And the colours?")]
    assert pair.ask(history).cached_tokens > 0


def test_4bit_experts_over_the_budget_are_computed_from_the_mapped_file_with_the_same_bits(engines, cache_dir):
    """A budget the 4-bit experts do not fit: they stay views of the checkpoint's file (the page cache
    keeps the hot ones), and the one-call experts kernel reads them there — the same answer, bit for bit."""
    path = engines("int4").loaded.path
    mapped = load_model(make_settings(cache_dir, model_path=path, max_memory_mb=1))
    assert mapped.weights_mapped
    experts = [m for m in mapped.model.modules() if isinstance(m, Experts)]
    assert experts and all(in_a_mapping_of(e.gate_up[0].qweight.data_ptr(), path) for e in experts)
    settings = make_settings(cache_dir, model_path=path, int8_kernel="native")
    a = greedy(Engine(mapped, settings), "Tell me about a red square.")
    b = greedy(engines("int4"), "Tell me about a red square.")
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


# -- published GPTQ / AWQ mixtures of experts ----------------------------------------------------


def write_published_moe(tiny_moe_dir, dst, method: str) -> dict[str, tuple]:
    """tiny-moe as GPTQModel / AutoAWQ publish a Qwen3-VL MoE: each expert its own 4-bit Linears
    (`experts.E.gate_proj`, `up_proj`, `down_proj`), attention and the dense MLP 4-bit, and (AWQ) the
    router 4-bit too; the vision tower, embedding and lm_head left as they were. Returns each published
    Linear's (values, zeros, scales)."""
    tensors, quantized = copied_without_weights(tiny_moe_dir, dst), {}
    for key in [k for k in tensors if k.startswith("model.language_model.layers.")]:
        name = key.rpartition(".")[0]
        if key.endswith("proj.weight") or (method == "awq" and key.endswith("mlp.gate.weight")):
            quantized[name] = publish_linear(tensors, name, tensors.pop(key), method)
        elif key.endswith("experts.gate_up_proj"):  # [experts, hidden, 2 × width]: gate columns, then up
            for e, both in enumerate(tensors.pop(key)):
                for part, weight in zip(("gate_proj", "up_proj"), both.t().chunk(2)):
                    quantized[f"{name}.{e}.{part}"] = publish_linear(tensors, f"{name}.{e}.{part}", weight, method)
        elif key.endswith("experts.down_proj"):  # [experts, width, hidden]
            for e, weight in enumerate(tensors.pop(key)):
                expert = f"{name}.{e}.down_proj"
                quantized[expert] = publish_linear(tensors, expert, weight.t(), method)
    save_published(dst, tensors, method)
    return quantized


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_published_mixture_of_experts_loads_with_exactly_its_weights_and_answers(
    cache_dir, tiny_moe_dir, tmp_path, method
):
    """MODEL_PATH at a GPTQ or AWQ mixture of experts: every expert holds exactly the published values,
    zero points and scales (gate and up side by side as the forward fuses them), a published router is
    its exact float matrix, and it answers. (The converted checkpoint is in the 4-bit format whose
    exactness the tests above prove.)"""
    from safetensors import safe_open

    src = tmp_path / method
    quantized = write_published_moe(tiny_moe_dir, src, method)
    settings = make_settings(cache_dir, model_path=src)
    loaded = load_model(settings)
    assert loaded.quantization == "int4"
    prefix = "model.language_model.layers.0.mlp"
    mlp = loaded.model.get_submodule(prefix)
    for e in range(8):
        parts = [quantized[f"{prefix}.experts.{e}.{p}"] for p in ("gate_proj", "up_proj")]
        for module, values in [
            (mlp.experts.gate_up[e], [torch.cat([part[i] for part in parts]) for i in range(3)]),
            (mlp.experts.down[e], quantized[f"{prefix}.experts.{e}.down_proj"]),
        ]:
            assert isinstance(module, Int4Linear)
            for name, tensor in pack(*values).items():
                assert torch.equal(getattr(module, name), tensor), (e, name)
    if method == "awq":  # the router's float matrix: scale · (value − zero), input by input
        values, zeros, scales = quantized[f"{prefix}.gate"]
        group = values.shape[1] // zeros.shape[1]
        offsets = values.float() - zeros.float().repeat_interleave(group, dim=1)
        assert torch.equal(mlp.gate.weight, offsets * scales.float().repeat_interleave(group, dim=1))
    else:
        with safe_open(tiny_moe_dir / "model.safetensors", "pt") as f:
            assert torch.equal(mlp.gate.weight, f.get_tensor(f"{prefix}.gate.weight").float())
    assert greedy(Engine(loaded, settings), "Hello there.").completion_tokens == 16


def test_a_published_mixture_with_an_expert_left_unquantized_is_refused_by_name(cache_dir, tiny_moe_dir, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = tmp_path / "gptq"
    write_published_moe(tiny_moe_dir, src, "gptq")
    with safe_open(src / "model.safetensors", "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    expert = "model.language_model.layers.2.mlp.experts.5.up_proj"
    for part in ("qweight", "qzeros", "scales", "g_idx"):
        del tensors[f"{expert}.{part}"]
    tensors[f"{expert}.weight"] = torch.zeros(96, 64)
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(published.UnsupportedCheckpoint, match=expert.replace(".", r"\.")):
        load_model(make_settings(cache_dir, model_path=src))
