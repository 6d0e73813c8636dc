"""The same answer on every CPU (docs/engine.md, "The same answer on every CPU"): this CPU's own paths
against everything forced to what an AVX2-only machine runs — the service's kernels built for
x86-64-v3 (NATIVE_MARCH), FBGEMM, oneDNN and MKL limited to AVX2, torch's own kernels dispatched to
their AVX2 versions (ATEN_CPU_CAPABILITY) — in two fresh Pythons (tests/isa_probe.py): every tensor an
answer depends on compared by its bits. Text, a picture and a clip, on fp32, INT8 and 4-bit weights,
a mixture of experts, and Qwen3.5's hybrid layers."""

from __future__ import annotations

import pytest

from conftest import HAS_AVX512, INT4_DIR, ONLY_AVX2, built_preset, run_probe

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

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_AVX512, reason=ONLY_AVX2)]


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


def test_the_forced_run_takes_the_avx2_paths_where_torchs_own_ops_round_otherwise(reports):
    """The control: the settings took hold (kernels built for x86-64-v3, torch on its AVX2 kernels), and
    there torch's own GELU and softmax — what the service computed before — give other bits."""
    own, forced = reports[0]["paths"], reports[1]["paths"]
    assert (own["march"], own["torch"]) == ("native", "AVX512")
    assert (forced["march"], forced["torch"]) == ("x86-64-v3", "AVX2")
    assert own["torch.gelu"] != forced["torch.gelu"] and own["torch.softmax"] != forced["torch.softmax"]


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
