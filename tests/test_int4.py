"""4-bit weights: the kernel (service/native/int4_gemm.c), group quantization, the 4-bit checkpoint
`python -m service quantize --bits 4` writes and the loader serves (in memory and mapped), and the
published GPTQ and AWQ layouts, converted exactly. The batch and cache exactness of 4-bit answers is
tested beside INT8's (tests/test_forward.py, tests/test_caches.py: the `int4` cases)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from service.engine.engine import Completion, Engine, GenerationRequest, SamplingParams
from service.memory import MemoryGuard
from service.model.loading import load_model
from service.model.prompts import ChatMessage, TextPart
from service.quant import published
from service.quant.int4_linear import Int4Linear, dequantize, pack, quantize_groups
from service.quant.int8_linear import Int8Linear
from service.quant.loader import load_quantized
from service.quant.packing import FORMAT_INT4, quantized_marker

from conftest import HAS_AVX512, ONLY_AVX2, in_a_mapping_of, make_settings, run_cli, run_probe, weights_settings


def float_layer(in_features=2048, out_features=320, seed=0, bias=True) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    nn.init.normal_(linear.weight, std=0.02)
    return linear


def rows(m, in_features=2048, seed=1) -> torch.Tensor:
    return torch.randn(m, in_features, generator=torch.Generator().manual_seed(seed))


def per_row_quantized(x: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies by: each row rounded to 64 steps of its absolute maximum, as the
    INT8 layers round it (x / step + 64, each operation rounded in float32, then to an integer)."""
    step = x.abs().amax(-1, keepdim=True) * 2.0**-6
    return (torch.div(x, step).add_(64).round_() - 64) * step


# -- the kernel ---------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 64, 193, 218])
def test_a_rows_output_is_the_same_bits_in_a_call_of_any_length(m, group):
    lin, x = Int4Linear.from_float(float_layer(), group), rows(218)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(m)])
    assert torch.equal(lin(x[:m]), alone)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group,out_features", [(32, 320), (128, 130), (64, 64)])
def test_the_kernel_multiplies_the_per_row_activations_by_the_dequantized_weights(group, out_features, symmetric):
    """Against float64 of the same operands (odd output counts: the padding channels never leak)."""
    layer = float_layer(out_features=out_features)
    values, zeros, scales = quantize_groups(layer.weight.detach(), group, symmetric)
    lin = Int4Linear(pack(values, zeros, scales), out_features, 2048, group, layer.bias)
    x = rows(37)
    expected = per_row_quantized(x).double() @ dequantize(values, zeros, scales).double().T + layer.bias.double()
    assert (lin(x).double() - expected).abs().max() < 1e-5 * expected.abs().max()


def test_a_spiking_neighbour_leaves_a_rows_output_unchanged():
    lin, x = Int4Linear.from_float(float_layer()), rows(8)
    spiked = x.clone()
    spiked[3] *= 1000
    assert torch.equal(lin(spiked)[[0, 1, 2, 4, 5, 6, 7]], lin(x)[[0, 1, 2, 4, 5, 6, 7]])


def test_rows_of_zeros_give_the_bias():
    layer = float_layer()
    lin = Int4Linear.from_float(layer)
    out = lin(torch.zeros(3, 2048))
    assert torch.equal(out, layer.bias.detach().expand(3, -1))


_ISA_PROBE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from service import native
native.configure(sys.argv[2])
from test_int4 import float_layer, rows
from service.quant.int4_linear import Int4Linear
lin = Int4Linear.from_float(float_layer(), 128)
out = {m: lin(rows(m)).flatten().tolist() for m in (1, 4, 9, 128)}
print(json.dumps({"out": out}))
"""


@pytest.mark.skipif(not HAS_AVX512, reason=ONLY_AVX2)
@pytest.mark.slow
def test_the_avx2_build_gives_the_same_bits(cache_dir):
    """NATIVE_MARCH=x86-64-v3 builds the kernel for AVX2 (8 lanes, vpmaddubsw, 2 rows per call):
    the same outputs bit for bit as this CPU's build, for a row, a batch and a prefill piece."""
    assert run_probe(_ISA_PROBE, cache_dir, {"NATIVE_MARCH": "x86-64-v3"}) == run_probe(_ISA_PROBE, cache_dir, {})


# -- group quantization --------------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [False, True])
def test_groups_hold_4_bit_values_and_a_gaussian_weight_keeps_its_shape(symmetric):
    weight = float_layer(out_features=256).weight.detach()
    values, zeros, scales = quantize_groups(weight, 64, symmetric)
    assert values.dtype == torch.uint8 and int(values.max()) <= 15
    assert zeros.shape == scales.shape == (256, 2048 // 64) and scales.dtype == torch.float16
    if symmetric:
        assert bool((zeros == 8).all())
    error = (dequantize(values, zeros, scales) - weight).norm() / weight.norm()
    assert 0.01 < error < 0.12  # 4-bit noise: present, and bounded


def test_a_row_of_zeros_stays_exactly_zero():
    weight = float_layer(out_features=64).weight.detach().clone()
    weight[5] = 0
    assert bool((dequantize(*quantize_groups(weight, 128)).T[:, 5] == 0).all())


# -- the checkpoint -----------------------------------------------------------------------------


def test_quantize_bits_4_writes_the_text_decoder_4_bit_and_keeps_the_vision_tower_int8(int4_dir, loaded_model):
    marker = quantized_marker(int4_dir)
    assert marker["format"] == FORMAT_INT4 and marker["keep_8bit"] == ["model.visual."]
    loaded = loaded_model("int4")  # the public loader's, from `int4_dir`
    assert loaded.quantization == "int4"
    model = loaded.model
    text = [m for n, m in model.named_modules() if n.startswith("model.language_model.") and hasattr(m, "in_features")]
    vision = [m for n, m in model.named_modules() if n.startswith("model.visual.") and hasattr(m, "in_features")]
    assert text and all(isinstance(m, Int4Linear) for m in text) and isinstance(model.lm_head, Int4Linear)
    assert vision and all(isinstance(m, Int8Linear) for m in vision)
    assert not any(type(m) is nn.Linear for m in model.modules())
    # about half the bytes of INT8 (plus a scale and a zero point per group)
    four = sum(m.nbytes() for m in text)
    eight = sum(m.in_features * m.out_features for m in text)
    assert four < 0.6 * eight


def test_the_command_line_writes_one_too_and_refuses_a_bad_group(tiny_dir, tmp_path):
    dst = tmp_path / "int4"
    run = run_cli("quantize", "--bits", "4", "--group-size", "32", str(tiny_dir), str(dst), timeout=300)
    assert run.returncode == 0, run.stderr
    assert "4-bit checkpoint" in run.stdout and f"MODEL_PATH={dst}" in run.stdout
    assert quantized_marker(dst)["group_size"] == 32
    bad = run_cli("quantize", "--bits", "4", "--group-size", "48", str(tiny_dir), str(tmp_path / "x"), timeout=60)
    assert bad.returncode != 0 and "--group-size" in bad.stderr


def greedy(engine: Engine, text: str, tokens=16) -> Completion:
    request = GenerationRequest(
        [ChatMessage("user", [TextPart(text)])], SamplingParams(max_tokens=tokens, temperature=0, logprobs=3)
    )
    return list(engine.generate(request))[-1]


@pytest.fixture(scope="module")
def int4_engine(cache_dir, loaded_model) -> Engine:
    return Engine(loaded_model("int4"), weights_settings(cache_dir, "int4"))


def test_4_bit_logits_stay_close_to_fp32_and_differ_from_them(int4_engine, fp32_engine):
    """4-bit rounding moves the logits (the comparison sees it), but not far (the tiny random model's
    weights are wide, uniform ones: bench/bench_fidelity.py measures the 2B-shaped checkpoint)."""
    tokenizer = fp32_engine.processor.tokenizer
    ids = tokenizer("Tell me a story about a red square.", return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = []
        for engine in (int4_engine, fp32_engine):
            engine.model.model.rope_deltas = None
            logits.append(engine.model(input_ids=ids).logits[0])
    cosine = nn.functional.cosine_similarity(*logits, dim=-1)
    assert cosine.mean() > 0.85 and cosine.min() > 0.7 and not torch.equal(*logits)


def test_weights_over_the_budget_are_computed_from_the_mapped_file_with_the_same_bits(cache_dir, int4_dir, int4_engine):
    """Memory-mapped, the 4-bit Linears run the same kernel on the file's own bytes: a text answer's
    log-probabilities are the same bits as from weights read into memory."""
    settings = make_settings(cache_dir, model_path=int4_dir, max_memory_mb=1)
    mapped = load_model(settings)
    assert mapped.weights_mapped
    int4 = [m for m in mapped.model.modules() if isinstance(m, Int4Linear)]
    assert int4 and all(in_a_mapping_of(m.qweight.data_ptr(), int4_dir) for m in int4)  # views of the file
    a = greedy(Engine(mapped, make_settings(cache_dir, model_path=int4_dir)), "Tell me about a red square.")
    b = greedy(int4_engine, "Tell me about a red square.")
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_the_4_bit_weights_are_used_in_place_from_the_mapped_file(int4_dir):
    from transformers import AutoConfig

    from service.model.skeleton import skeleton
    from service.quant.kernel_choice import KernelChoice

    model = skeleton(AutoConfig.from_pretrained(int4_dir))
    over_budget = load_quantized(model, int4_dir, 2, MemoryGuard(None), KernelChoice(decoder="native", vision="native"))
    assert not over_budget and isinstance(model.lm_head, Int4Linear)
    assert in_a_mapping_of(model.lm_head.qweight.data_ptr(), int4_dir)  # the file's own bytes, nothing copied


# -- published layouts (GPTQ, AWQ) --------------------------------------------------------------


def pack_words(values: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 8w] of 4-bit values → int32 [..., w], low nibble first: how both layouts pack."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (values.to(torch.int64).unflatten(-1, (-1, 8)) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def gptq_tensors(name, values, zeros, scales, v1: bool, g_idx=None) -> dict[str, torch.Tensor]:
    """One Linear in GPTQ's layout: qweight [in/8, out] packs 8 inputs of an output per word, qzeros
    [groups, out/8] 8 outputs' zero points per word (v1 stores each minus one)."""
    stored = ((zeros.to(torch.int16) - 1) & 15).to(torch.uint8) if v1 else zeros
    in_order = torch.arange(values.shape[1], dtype=torch.int32) // (values.shape[1] // zeros.shape[1])
    return {
        f"{name}.qweight": pack_words(values).T.contiguous(),
        f"{name}.qzeros": pack_words(stored.T.contiguous()),
        f"{name}.scales": scales.T.contiguous(),
        f"{name}.g_idx": in_order if g_idx is None else g_idx,
    }


def awq_tensors(name, values, zeros, scales) -> dict[str, torch.Tensor]:
    """One Linear in AWQ's GEMM layout (both packed along the outputs, interleaved 0 2 4 6 1 3 5 7)."""
    order = torch.tensor(published.AWQ_ORDER)

    def interleaved(t):  # [rows, out] → words of outputs 8j + AWQ_ORDER[i] in nibble i
        return pack_words(t.unflatten(-1, (-1, 8))[..., order].flatten(-2))

    return {
        f"{name}.qweight": interleaved(values.T.contiguous()),
        f"{name}.qzeros": interleaved(zeros.T.contiguous()),
        f"{name}.scales": scales.T.contiguous(),
    }


def write_published(tiny_dir, dst, method: str, group=32, act_order=False) -> dict[str, tuple]:
    """The tiny checkpoint with every text-decoder Linear 4-bit in a published layout (vision tower
    and embedding left as they are, as publishers do); returns each Linear's (values, zeros, scales)."""
    tensors, quantized = copied_without_weights(tiny_dir, dst), {}
    for key in [k for k in tensors if k.startswith("model.language_model.layers.") and k.endswith("proj.weight")]:
        name = key[: -len(".weight")]
        quantized[name] = publish_linear(tensors, name, tensors.pop(key), method, group, act_order)
    save_published(dst, tensors, method, group, act_order)
    return quantized


def copied_without_weights(src, dst) -> dict[str, torch.Tensor]:
    """dst: src's files but its weights, which are returned (to be written back in another layout)."""
    from safetensors import safe_open

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


def publish_linear(tensors: dict, name: str, weight: torch.Tensor, method: str, group=32, act_order=False) -> tuple:
    """`weight` (out × in) added to `tensors` as the published 4-bit Linear `name`; returns its
    (values, zeros, scales)."""
    values, zeros, scales = quantize_groups(weight, group)
    zeros = zeros.clamp(min=1)  # GPTQ v1 cannot store a zero point of 0 (it keeps zero − 1 in 4 bits)
    if method == "awq":
        tensors.update(awq_tensors(name, values, zeros, scales))
    else:
        g_idx = None
        if act_order:
            g_idx = torch.arange(values.shape[1], dtype=torch.int32) // group
            g_idx = g_idx[torch.randperm(len(g_idx), generator=torch.Generator().manual_seed(0))]
        tensors.update(gptq_tensors(name, values, zeros, scales, v1=method == "gptq", g_idx=g_idx))
    return values, zeros, scales


def save_published(dst, tensors: dict, method: str, group=32, act_order=False) -> None:
    """`tensors` as dst's weights, and its config.json's quantization_config for `method`."""
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
        if method == "awq"
        else {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": act_order,
            "sym": False,
            "checkpoint_format": "gptq" if method == "gptq" else "gptq_v2",
        }
    )
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("method", ["gptq", "gptq_v2", "awq"])
def test_a_published_checkpoint_loads_with_exactly_its_weights_and_answers(cache_dir, tiny_dir, tmp_path, method):
    """MODEL_PATH at a GPTQ (v1 and v2) or AWQ checkpoint: converted once into CACHE_DIR, every
    4-bit Linear holds exactly the published values, zero points and scales (the packed bytes of
    the same values equal), the rest INT8, and it answers."""
    src = tmp_path / method
    quantized = write_published(tiny_dir, src, method)
    settings = make_settings(cache_dir, model_path=src)
    loaded = load_model(settings)
    assert loaded.quantization == "int4" and str(loaded.path).startswith(str(cache_dir / "converted"))
    model = loaded.model
    for layer_name, layer in [(n, m) for n, m in model.named_modules() if n.endswith(".self_attn")]:
        parts = [quantized[f"{layer_name}.{p}"] for p in ("q_proj", "k_proj", "v_proj")]
        expected = pack(*(torch.cat([part[i] for part in parts]) for i in range(3)))
        assert isinstance(layer.qkv_proj, Int4Linear)
        for name, tensor in expected.items():
            assert torch.equal(getattr(layer.qkv_proj, name), tensor), name
    assert isinstance(model.lm_head, Int8Linear)  # published unquantized: INT8 here
    done = greedy(Engine(loaded, settings), "Hello there.")
    assert done.completion_tokens == 16
    again = load_model(settings)  # converted once: the second start reads the conversion
    assert again.path == loaded.path


def test_what_a_published_layout_cannot_keep_exactly_is_refused_by_name(cache_dir, tiny_dir, tmp_path):
    write_published(tiny_dir, tmp_path / "act-order", "gptq", act_order=True)
    with pytest.raises(published.UnsupportedCheckpoint, match="act-order"):
        load_model(make_settings(cache_dir, model_path=tmp_path / "act-order"))
    for config, words in [
        ({"quant_method": "gptq", "bits": 8}, "8 bits"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "GEMM"),
        ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
    ]:
        src = tmp_path / f"bad-{len(words)}"
        shutil.copytree(tiny_dir, src)
        settings = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**settings, "quantization_config": config}))
        with pytest.raises(published.UnsupportedCheckpoint, match=words):
            load_model(make_settings(cache_dir, model_path=src))


# -- served -------------------------------------------------------------------------------------


def test_gunicorn_serves_a_4_bit_checkpoint_to_the_openai_client_with_the_loaders_answer(serve, int4_dir, int4_engine):
    """MODEL_PATH at the 4-bit checkpoint is all a user does: the model card says int4, the official
    client gets the answer the loader's engine gives (the same tokens and log-probabilities)."""
    from servers import openai_client

    expected = greedy(int4_engine, "Tell me about a red square.")
    with serve({"MODEL_PATH": str(int4_dir), "PRELOAD": "true"}, "int4") as (base, _):
        client = openai_client(base)
        assert client.models.list().data[0].model_extra["quantization"] == "int4"
        reply = client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "Tell me about a red square."}],
            max_tokens=16,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
        )
    content = reply.choices[0].logprobs.content
    assert reply.choices[0].message.content == expected.text and content
    assert [t.logprob for t in content] == [r.logprob for r in expected.logprobs][: len(content)]
