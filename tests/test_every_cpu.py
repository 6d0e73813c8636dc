"""The same answer on every CPU (docs/engine.md, "The same answer on every CPU"): this CPU's own paths
against everything forced to what an AVX2-only machine runs — the service's kernels built for
x86-64-v3 (NATIVE_MARCH), FBGEMM, oneDNN and MKL limited to AVX2, torch's own kernels dispatched to
their AVX2 versions (ATEN_CPU_CAPABILITY) — in two fresh Pythons (tests/isa_probe.py): every tensor an
answer depends on compared by its bits. Text, a picture and a clip, on fp32, INT8 and 4-bit weights,
a mixture of experts, and Qwen3.5's hybrid layers. Then the answer's fingerprint (`answer_digest`)
through HTTP: the same on every API and every replay, here and on an instance forced to AVX2."""

from __future__ import annotations

import base64

import anthropic
import pytest
import requests

from conftest import HAS_AVX512, INT4_DIR, ONLY_AVX2, SHARED_ENV, built_preset, run_probe
from imaging import data_url, encode, pattern
from servers import openai_client

# What an AVX2-only machine runs, forced on this one.
FORCED_AVX2 = {
    "NATIVE_MARCH": "x86-64-v3",
    "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
}
# run_probe's script: tests/isa_probe.py with the session's cache (the checkpoints in PROBE_SPECS)
PROBE = """
import runpy, sys
sys.argv = [sys.argv[1] + "/isa_probe.py", sys.argv[2]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

pytestmark = pytest.mark.slow
AVX512_ONLY = pytest.mark.skipif(not HAS_AVX512, reason=ONLY_AVX2)


@pytest.fixture(scope="module")
def checkpoints(cache_dir, tiny_dir, int4_dir, tiny_moe_dir) -> dict[str, str]:
    """name → PATH:QUANTIZATION of each checkpoint the probe loads (built once per test cache)."""
    from service.quant.writer import write_quantized

    moe_int4 = cache_dir / "tiny-moe-int4"  # test_moe.py's, where it made it already
    if not (moe_int4 / "config.json").exists():
        write_quantized(tiny_moe_dir, moe_int4, progress=False, bits=4)
    return {
        "tiny fp32": f"{tiny_dir}:fp32",
        "tiny int8": f"{tiny_dir}:int8",
        "tiny 4-bit": f"{cache_dir / INT4_DIR}:int8",
        "tiny-moe int8": f"{tiny_moe_dir}:int8",
        "tiny-moe 4-bit": f"{moe_int4}:int8",
        "tiny-qwen35 int8": f"{built_preset(cache_dir, 'tiny-qwen35')}:int8",
        "tiny-qwen35-moe fp32": f"{built_preset(cache_dir, 'tiny-qwen35-moe')}:fp32",
    }


@pytest.fixture(scope="module")
def reports(cache_dir, checkpoints) -> tuple[dict, dict]:
    """(this CPU's report, the forced AVX2 one)."""

    def probe(env: dict[str, str]) -> dict:
        specs = [f"{name}={spec}" for name, spec in checkpoints.items()]
        return run_probe(PROBE, cache_dir, {**env, "PROBE_SPECS": "\n".join(specs)})

    return probe({}), probe(FORCED_AVX2)


@AVX512_ONLY
def test_the_forced_run_takes_the_avx2_paths_where_torchs_own_ops_round_otherwise(reports):
    """The control: the settings took hold (kernels built for x86-64-v3, torch on its AVX2 kernels), and
    there torch's own GELU and softmax — what the service computed before — give other bits."""
    own, forced = reports[0]["paths"], reports[1]["paths"]
    assert (own["march"], own["torch"]) == ("native", "AVX512")
    assert (forced["march"], forced["torch"]) == ("x86-64-v3", "AVX2")
    assert own["torch.gelu"] != forced["torch.gelu"] and own["torch.softmax"] != forced["torch.softmax"]


@AVX512_ONLY
def test_every_tensor_of_every_answer_is_the_same_bits_on_the_avx2_paths(reports, checkpoints):
    """Vision features (a picture, a clip), every prompt row's logits, four decode steps, every layer's
    keys and values (recurrent states in Qwen3.5's linear-attention layers), and a sampled answer's
    token ids, logprobs and answer_digest."""
    own, forced = reports
    assert set(own) == set(forced) == {"paths", *checkpoints}
    for name in checkpoints:
        assert len(own[name]) >= 15 and "clip.pooler" in own[name] and len(own[name]["answer.digest"]) == 35
        differing = sorted(key for key in own[name] if own[name][key] != forced[name][key])
        assert differing == [], f"{name}: {differing}"


# -- the answer's fingerprint, through HTTP ------------------------------------------------------------

PNG = encode(pattern(224, 160, seed=23), ".png")
QUESTION = "What is in this picture?"
SAMPLED = {"max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 5, "logprobs": True, "top_logprobs": 2}


def chat(base: str, **extra):
    picture = {"type": "image_url", "image_url": {"url": data_url(PNG)}}
    messages = [{"role": "user", "content": [picture, {"type": "text", "text": QUESTION}]}]
    return openai_client(base).chat.completions.create(model="qwen3-vl", messages=messages, **{**SAMPLED, **extra})


def digest_of(reply) -> str:
    return reply.model_extra["answer_digest"]


def logprobs_of(reply) -> list:
    return [(t.token, t.logprob) for t in reply.choices[0].logprobs.content]


@pytest.fixture(scope="module")
def forced_avx2_server(serve):
    """An instance with the shared server's settings, on the paths of an AVX2-only machine."""
    with serve({**SHARED_ENV, **FORCED_AVX2}, "forced-avx2") as (base, _):
        yield base


def test_the_same_request_gives_the_same_digest_on_every_api_and_every_replay(shared_server):
    first, again = chat(shared_server), chat(shared_server)  # the second from the cached prompt
    digest = digest_of(first)
    assert digest.startswith("ad_") and len(digest) == 35 and digest_of(again) == digest
    assert logprobs_of(again) == logprobs_of(first)
    chunks = list(chat(shared_server, stream=True, stream_options={"include_usage": True}))
    assert [c.model_extra.get("answer_digest") for c in chunks[-2:]] == [digest, digest]  # finishing, usage
    assert all(c.model_extra.get("answer_digest") is None for c in chunks[:-2])
    native = requests.post(
        shared_server + "/v1/chat",
        files=[("image", ("p.png", PNG, "image/png"))],
        data={"prompt": QUESTION, "stream": "false", **{k: str(v) for k, v in SAMPLED.items() if k != "top_logprobs"}},
    ).json()
    assert native["answer_digest"] == digest  # the same answer: the same digest, whichever API asked
    other = chat(shared_server, seed=6)
    assert digest_of(other) != digest and logprobs_of(other) != logprobs_of(first)


def test_responses_and_messages_answers_carry_the_digest_of_the_same_answer(shared_server):
    """Greedy, the same question through Chat Completions, Responses and Anthropic Messages (streamed
    too): one answer, one digest."""
    greedy = chat(shared_server, temperature=0, seed=None, top_p=None, logprobs=None, top_logprobs=None)
    digest = digest_of(greedy)
    image = {"type": "input_image", "image_url": data_url(PNG)}
    response = openai_client(shared_server).responses.create(
        model="qwen3-vl",
        input=[{"role": "user", "content": [image, {"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=16,
        temperature=0,
    )
    assert response.model_extra["answer_digest"] == digest
    messages = anthropic.Anthropic(base_url=shared_server, api_key="unused", max_retries=0, timeout=120).messages
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}
    content = [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]
    ask = dict(model="qwen3-vl", max_tokens=16, messages=[{"role": "user", "content": content}])
    reply = messages.create(**ask, extra_body={"temperature": 0})
    assert reply.model_extra["answer_digest"] == digest
    with messages.stream(**ask, extra_body={"temperature": 0}) as stream:
        events = list(stream)
    [delta] = [e for e in events if e.type == "message_delta"]
    assert delta.model_extra["answer_digest"] == digest


@AVX512_ONLY
def test_an_answer_replayed_on_an_avx2_instance_has_the_same_digest_and_logprobs(shared_server, forced_avx2_server):
    here, there = chat(shared_server), chat(forced_avx2_server)
    assert digest_of(there) == digest_of(here)
    assert there.choices[0].message.content == here.choices[0].message.content
    assert logprobs_of(there) == logprobs_of(here)
