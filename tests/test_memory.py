"""The memory budget (MAX_MEMORY_MB) on real memory: caches give memory back first, then requests
are refused with 503; a model larger than the budget is served from memory-mapped weights."""

from __future__ import annotations

import logging
import os
import select

import pytest
import requests
import torch

from service import metrics
from service.caches.lru import BudgetedLRU
from service.engine.engine import Engine, GenerationRequest, SamplingParams
from service.errors import Unavailable
from service.footprint import ModelTooLarge
from service.memory import (
    EVICT_AT,
    MIB,
    MemoryGuard,
    cgroup_memory,
    default_budget_bytes,
    machine_memory_bytes,
    release_memory,
)
from service.model.loading import load_model
from service.model.prompts import ChatMessage, TextPart
from service.quant.int8_linear import Int8Linear, MappedInt8Linear
from service.quant.writer import write_quantized

from conftest import in_a_mapping_of, make_settings
from imaging import encode, pattern
from servers import gunicorn_server, metric


def question(max_tokens=8) -> GenerationRequest:
    return GenerationRequest(
        [ChatMessage("user", [TextPart("Tell me a story about a red square.")])],
        SamplingParams(max_tokens=max_tokens, temperature=0),
    )


@pytest.fixture
def big_cache():
    """A real cache holding 256 MiB of real (touched) tensors."""
    lru = BudgetedLRU("test", max_bytes=1024 * MIB, max_entries=8, ttl_seconds=600)
    for i in range(4):
        lru.put(f"k{i}", torch.ones(16 * MIB), 64 * MIB)
    yield lru
    lru.clear()
    release_memory()


def test_caches_are_evicted_before_a_request_is_refused(big_cache):
    guard = MemoryGuard(None, [big_cache.shrink])
    # 96 MiB past the eviction mark (EVICT_AT of the budget): two of the four 64 MiB entries must go.
    guard.budget_bytes = int((guard.used_bytes() - 96 * MIB) / EVICT_AT)
    evicted = metrics.CACHE_EVICTIONS.labels(cache="test", reason="memory")
    before = evicted._value.get()
    guard.check()  # no error: evicting was enough
    assert big_cache.keys() == ["k2", "k3"]  # the oldest went first, and no more than needed
    assert evicted._value.get() - before == 2  # counted in /metrics under reason="memory"
    assert guard.used_bytes() <= guard.budget_bytes * EVICT_AT


def test_request_that_would_not_fit_even_after_eviction_is_refused(big_cache):
    guard = MemoryGuard(None, [big_cache.shrink])
    guard.budget_bytes = guard.used_bytes() + 64 * MIB
    with pytest.raises(Unavailable, match="MAX_MEMORY_MB") as exc:
        guard.check(needed_bytes=2048 * MIB)
    assert exc.value.status == 503 and exc.value.code == "memory_budget"
    assert len(big_cache) == 0  # everything was tried first


def test_a_guard_built_before_a_fork_measures_the_child_it_runs_in():
    """Gunicorn's preloading master builds the guard, the worker uses it: the worker's growth must count."""
    guard = MemoryGuard(1 << 40)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: grow by 256 MiB of touched memory that the parent does not have
        try:  # (bytes, not torch: a forked child must not touch the parent's OpenMP team)
            before = guard.used_bytes()
            ballast = b"\x01" * (256 * MIB)
            os.write(write, str(guard.used_bytes() - before).encode())
            del ballast
        finally:
            os._exit(0)
    os.close(write)
    ready, _, _ = select.select([read], [], [], 60)
    assert ready, "the forked child did not report"
    grown = int(os.read(read, 64))
    os.waitpid(pid, 0)
    assert grown >= 250 * MIB


def test_unset_budget_is_the_machines_memory_less_a_margin():
    guard = MemoryGuard.from_settings(make_settings("/tmp"))
    memory, _ = machine_memory_bytes()
    assert guard.budget_bytes == memory - max(256 * MIB, memory // 10) == default_budget_bytes(1)
    assert default_budget_bytes(4) == guard.budget_bytes // 4
    with pytest.raises(Unavailable):
        guard.check(needed_bytes=memory)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_cgroup_memory_limit_is_read_in_either_cgroup_version(tmp_path, version):
    own = tmp_path / ("memory/box" if version == "v1" else "box")
    own.mkdir(parents=True)
    if version == "v1":
        (tmp_path / "proc").write_text("5:memory:/box\n1:cpu:/\n")
        (own / "memory.limit_in_bytes").write_text("4294967296\n")
        (own / "memory.usage_in_bytes").write_text("1000\n")
    else:
        (tmp_path / "proc").write_text("0::/box\n")
        (own / "memory.max").write_text("4294967296\n")
        (own / "memory.current").write_text("1000\n")
    assert cgroup_memory(tmp_path / "proc", tmp_path) == (4 * 1024**3, 1000)
    (own / ("memory.limit_in_bytes" if version == "v1" else "memory.max")).write_text(
        "9223372036854771712\n" if version == "v1" else "max\n"
    )
    assert cgroup_memory(tmp_path / "proc", tmp_path) is None


@pytest.mark.server
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_under_a_cgroup_limit_the_default_budget_follows_it_and_holds(cache_dir, tiny_dir, tmp_path, request, weights):
    """Gunicorn started in a memory cgroup of 1.5 GiB, no MAX_MEMORY_MB, no cache budgets: the budget
    is the limit less the margin, the caches get shares of what is left after loading, and a run of
    picture conversations stays inside the limit without an OOM kill — INT8 weights quantized at load,
    and the 4-bit checkpoint."""
    from cgroups import memory_cgroup

    limit = 1536 * MIB
    with memory_cgroup(limit) as cgroup:
        env = {"CACHE_DIR": str(cache_dir)}
        if weights == "int4":
            env["MODEL_PATH"] = str(request.getfixturevalue("int4_dir"))
        with gunicorn_server(env, tmp_path / "gunicorn.log", preexec_fn=cgroup.enter) as (base, _):
            budget = metric(base, "qwen3vl_memory_budget_bytes")
            assert budget == limit - 256 * MIB
            kv_budget = metric(base, "qwen3vl_cache_budget_bytes", 'cache="conversation"')
            vision_budget = metric(base, "qwen3vl_cache_budget_bytes", 'cache="vision"')
            assert 0 < kv_budget < budget and 0 < vision_budget < kv_budget
            for i in range(6):
                conversation = f"c{i}"
                for turn in range(3):
                    files = (
                        {"image": (f"p{i}.png", encode(pattern(320, 240, seed=i), ".png"), "image/png")}
                        if turn == 0
                        else None
                    )
                    reply = requests.post(
                        base + "/v1/chat",
                        data={
                            "prompt": f"Turn {turn}: tell me more.",
                            "conversation_id": conversation,
                            "max_tokens": "16",
                            "stream": "false",
                        },
                        files=files,
                        timeout=120,
                    )
                    assert reply.status_code == 200, reply.text
            assert metric(base, "qwen3vl_cache_hits_total", 'cache="conversation"') >= 6
        assert cgroup.oom_kills() == 0 and cgroup.peak_bytes() <= limit


@pytest.mark.slow
def test_engine_over_budget_answers_503_with_a_clear_message(cache_dir, loaded_model):
    settings = make_settings(cache_dir, quantization="int8", max_memory_mb=1)
    engine = Engine(loaded_model("int8"), settings)  # (the budget bounds a pre-quantized checkpoint's load only)
    for attempt in (lambda: next(engine.generate(question())), lambda: engine.submit(question())):
        with pytest.raises(Unavailable) as exc:
            attempt()
        assert exc.value.status == 503
        assert "of its 1 MiB (MAX_MEMORY_MB)" in exc.value.message and "retry later" in exc.value.message
    assert not engine.admission.busy  # refused before taking the model


@pytest.mark.slow
def test_engine_within_budget_answers(cache_dir, loaded_model):
    settings = make_settings(cache_dir, quantization="int8", max_memory_mb=64 * 1024)
    engine = Engine(loaded_model("int8"), settings)
    assert list(engine.generate(question()))[-1].completion_tokens == 8


@pytest.mark.slow
def test_model_larger_than_the_budget_is_served_from_its_mapped_files_with_the_same_bits(
    cache_dir, tiny_dir, tmp_path, caplog
):
    """Over the budget every INT8 Linear runs the native kernel on the mapped file (the OS may drop
    its pages and read them back): the same bits as the kernel choice's own Linears."""
    int8_dir = write_quantized(tiny_dir, tmp_path / "int8", progress=False)
    packed = load_model(make_settings(cache_dir, model_path=int8_dir, int8_kernel="fbgemm"))
    with caplog.at_level(logging.WARNING):
        mapped = load_model(make_settings(cache_dir, model_path=int8_dir, int8_kernel="fbgemm", max_memory_mb=1))
    assert mapped.weights_mapped and not packed.weights_mapped
    int8 = [m for m in mapped.model.modules() if isinstance(m, Int8Linear)]
    assert int8 and all(m.kernel == "native" and in_a_mapping_of(m._packed.data_ptr(), int8_dir) for m in int8)
    assert all(m.kernel == "fbgemm" for m in packed.model.modules() if isinstance(m, Int8Linear))  # its own copies
    assert "more than MAX_MEMORY_MB leaves" in caplog.text and "served from the mapped files" in caplog.text
    ids = packed.processor.tokenizer("Tell me a story about a red square.", return_tensors="pt").input_ids
    with torch.inference_mode():
        assert torch.equal(packed.model(input_ids=ids).logits, mapped.model(input_ids=ids).logits)


def test_a_checkpoint_whose_weights_cannot_fit_the_budget_is_refused_with_the_4bit_command(cache_dir, tiny_dir):
    """Quantizing at load the tiny model's ~0.7 M parameters peaks at ~2.7 MB of weights: a 1 MiB
    budget refuses it before any weight is read, naming the bytes and the command whose checkpoint
    would be served instead; 16 MiB lets the load go on (requests are then refused one by one)."""
    with pytest.raises(ModelTooLarge) as refused:
        load_model(make_settings(cache_dir, model_path=tiny_dir, quantization="int8", max_memory_mb=1))
    message = str(refused.value)
    assert "0.72 M parameters" in message and "more than the memory budget of 0.00 GiB" in message
    assert f"python -m service quantize --bits 4 {tiny_dir} {tiny_dir}-int4" in message
    with pytest.raises(ModelTooLarge, match="in fp32"):
        load_model(make_settings(cache_dir, model_path=tiny_dir, quantization="fp32", max_memory_mb=1))
    assert load_model(make_settings(cache_dir, model_path=tiny_dir, quantization="int8", max_memory_mb=16)).model


@pytest.mark.server
def test_http_request_over_budget_gets_503_json_error(cache_dir, tiny_dir, tmp_path):
    env = {"CACHE_DIR": str(cache_dir), "MAX_MEMORY_MB": "16"}  # the weights fit; the running server does not
    with gunicorn_server(env, tmp_path / "gunicorn.log") as (base, _):
        reply = requests.post(
            base + "/v1/chat/completions",
            timeout=60,
            json={"model": "any", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello there"}]},
        )
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["code"] == "memory_budget" and "of its 16 MiB (MAX_MEMORY_MB)" in error["message"]


def test_mapped_weights_compute_any_row_count_even_unaligned():
    """torch's bf16 int8 kernel crashes on weights not 16-byte aligned from 4 rows on (seen on this
    torch): checkpoints are written 64-byte aligned, and an unaligned (older) one is computed in
    pieces of 3 rows instead."""
    rows = torch.randint(-127, 128, (256 * 128 + 64,), dtype=torch.int8)
    scales = torch.rand(256) / 100
    aligned = MappedInt8Linear([(rows[: 256 * 128].view(256, 128), scales)], None)
    unaligned = MappedInt8Linear([(rows[8 : 8 + 256 * 128].view(256, 128), scales)], None)
    assert unaligned.rows0.data_ptr() % 16
    x = torch.randn(7, 128)
    expected = x.bfloat16().float() @ (unaligned.rows0.float() * scales[:, None]).T
    out = unaligned(x)
    assert torch.allclose(out, expected, rtol=2e-2, atol=2e-2)
    assert aligned(x).shape == out.shape == (7, 256)


def test_quantized_shards_hold_every_tensor_64_byte_aligned(tmp_path):
    from safetensors import safe_open

    from service.quant.packing import ALIGNMENT, SafetensorsReader, write_aligned_safetensors

    tensors = {
        "a.weight": torch.randint(-127, 128, (64, 128), dtype=torch.int8),
        "a.weight_scale": torch.rand(64),
        "b.weight": torch.randint(-127, 128, (192, 64), dtype=torch.int8),
        "b.bias": torch.rand(192),
    }
    write_aligned_safetensors(tensors, tmp_path / "x.safetensors")
    reader = SafetensorsReader(tmp_path / "x.safetensors")
    assert reader.data_start % ALIGNMENT == 0
    assert all(entry["data_offsets"][0] % ALIGNMENT == 0 for entry in reader.entries.values())
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert all(torch.equal(f.get_tensor(name), t) for name, t in tensors.items())
