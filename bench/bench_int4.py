"""4-bit weights: which group size and zero point, and which kernel, by measurement on this machine.

    flock /tmp/heavy.lock python -m bench.bench_int4

For every group size (32, 64, 128, 256), asymmetric (a zero point per group) and symmetric (zero
point 8): the weights' relative error (‖dequantized − fp32‖ / ‖fp32‖) over a sample of the 2B-shaped
checkpoint's decoder Linears (and the vision tower's), the bytes a weight costs with its scales and
zero points, and the service's 4-bit kernel's time for one 2048 → 6144 layer (24 copies cycled, so
weights come from DRAM, as in a decode step) at 1, 4, 64 and 218 rows — beside the INT8 native kernel,
ONNX Runtime's `MatMulNBits` (int8 activations per block of inputs) and torch's own 4-bit CPU kernel
(`_weight_int4pack_mm_for_cpu`, bf16 activations): for those two, neither the INT8 layers' per-row
bits nor a row's independence from its neighbours are given, so they are speed references.
One process, 2 threads; timings are the fastest of 7 rounds, the kernels taking turns in each.

`--memory`: the 4-bit checkpoint (and the INT8 one, for comparison) served by Gunicorn inside a
memory cgroup of 2 GiB (`--cgroup-mib`): resident memory once ready (PSS of master and worker), then
10 conversations of 3 turns, each beginning with a picture (30 requests), and the cgroup's peak and
OOM kills.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.core.client import picture_conversations
from bench.core.harness import parse, parser, tree_memory
from bench.core.results import markdown_table, report
from bench.core.servers import gunicorn_server, memory_cgroup

GROUPS = (32, 64, 128, 256)
ROWS = (1, 4, 64, 218)
COPIES = 24
SAMPLE = (  # (checkpoint Linear, how many of its layers) sampled for the weight error
    ("model.language_model.layers.{}.mlp.gate_proj", (0, 13, 27)),
    ("model.language_model.layers.{}.mlp.down_proj", (0, 13, 27)),
    ("model.language_model.layers.{}.self_attn.q_proj", (0, 13, 27)),
    ("model.visual.blocks.{}.mlp.linear_fc1", (0, 12, 23)),
)


def fastest_ms(kernels: dict, inputs: dict, rounds: int = 7) -> dict:
    """kernel → [ms per call at each of ROWS]: the fastest of `rounds`, the kernels taking turns in
    every round (this machine's speed drifts: turns keep the drift out of the comparison)."""
    best = {k: [float("inf")] * len(ROWS) for k in kernels}
    for _ in tqdm(range(rounds), desc="kernel rounds", unit="round"):
        for name, (layers, dtype) in kernels.items():
            for i, m in enumerate(ROWS):
                x = inputs[m].to(dtype)
                layers[0](x)
                began = time.perf_counter()
                for layer in layers:
                    layer(x)
                best[name][i] = min(best[name][i], (time.perf_counter() - began) / len(layers) * 1000)
    return best


def weight_errors(source) -> dict:
    """(group, symmetric) → (decoder relative error, vision relative error) over SAMPLE."""
    from service.quant.int4_linear import dequantize, quantize_groups
    from service.quant.source_tensors import SourceTensors as _SourceTensors

    source_tensors = _SourceTensors(source)
    weights = {}
    for pattern, layers in SAMPLE:
        for i in layers:
            name = pattern.format(i) + ".weight"
            weights[name] = source_tensors.read([name])[name].float()
    errors = {}
    for group in tqdm(GROUPS, desc="weight error", unit="group size"):
        for symmetric in (False, True):
            sums = {"decoder": [0.0, 0.0], "vision": [0.0, 0.0]}
            for name, w in weights.items():
                part = "vision" if name.startswith("model.visual.") else "decoder"
                d = dequantize(*quantize_groups(w, group, symmetric))
                sums[part][0] += float((d - w).square().sum())
                sums[part][1] += float(w.square().sum())
            errors[group, symmetric] = {p: (e / n) ** 0.5 for p, (e, n) in sums.items()}
    return errors


def matmul_nbits(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, threads: int, copies=1):
    """ONNX Runtime's 4-bit MatMulNBits (block `group`, int8 activations per block: accuracy_level 4)
    on the same weights, as a callable on fp32 rows: a graph of `copies` such nodes side by side (each
    its own weights: copy i's bytes xor i, for ONNX Runtime would share equal ones) in one session, so
    one thread pool serves them all (a session each would start a pool each, and their spinning
    threads would fight over the cores)."""
    import numpy as np
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper

    n, k = values.shape
    v = values.reshape(n, k // group, group // 2, 2)
    blob = (v[..., 0] | (v[..., 1] << 4)).numpy().astype(np.uint8)  # element 2i low nibble, 2i+1 high
    z = zeros.reshape(n, -1)
    if z.shape[1] % 2:
        z = torch.cat([z, torch.zeros(n, 1, dtype=z.dtype)], 1)
    packed_zeros = (z[:, 0::2] | (z[:, 1::2] << 4)).numpy().astype(np.uint8).reshape(-1)
    nodes, outputs, initializers = [], [], []
    for i in range(copies):
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                ["A", f"B{i}", f"scales{i}", f"zero_points{i}"],
                [f"Y{i}"],
                domain="com.microsoft",
                K=k,
                N=n,
                bits=4,
                block_size=group,
                accuracy_level=4,
            )
        )
        outputs.append(helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, ["M", n]))
        initializers += [
            onnx.numpy_helper.from_array(blob ^ np.uint8(i), f"B{i}"),  # other bytes: ORT shares equal ones
            onnx.numpy_helper.from_array(scales.float().numpy().reshape(-1), f"scales{i}"),
            onnx.numpy_helper.from_array(packed_zeros, f"zero_points{i}"),
        ]
    graph = helper.make_graph(
        nodes, "matmul_nbits", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])], outputs, initializers
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"A": x.numpy()})


def kernel_times(threads: int) -> dict:
    from service.quant.int4_linear import Int4Linear, pack, quantize_groups
    from service.quant.int8_linear import Int8Linear, quantize_rows

    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6144, 2048, generator=generator) * 0.02
    inputs = {m: torch.randn(m, 2048, generator=generator) for m in ROWS}
    kernels = {}
    with torch.inference_mode():
        rows, scales = quantize_rows(weight)
        kernels["INT8 native (per-row activations)"] = (
            [Int8Linear(rows.clone(), scales, None, kernel="native") for _ in range(COPIES)],
            torch.float32,
        )
        for group in GROUPS:
            packed = pack(*quantize_groups(weight, group))
            kernels[f"4-bit native, group {group} (per-row activations)"] = (
                [Int4Linear({k: v.clone() for k, v in packed.items()}, 6144, 2048, group, None) for _ in range(COPIES)],
                torch.float32,
            )
        values, zeros, scales = quantize_groups(weight, 128)
        every_copy = matmul_nbits(values, scales, zeros, 128, threads, COPIES)  # one call computes all COPIES
        kernels["ONNX Runtime `MatMulNBits`, block 128, `accuracy_level=4` (int8 activations per block)"] = (
            [every_copy] + [lambda x: None] * (COPIES - 1),
            torch.float32,
        )
        try:  # torch's own: bf16 activations, group 128, weights packed for its CPU kernel
            w_int = torch.randint(0, 16, (6144, 2048), dtype=torch.int32, generator=generator)
            packed_w = torch._convert_weight_to_int4pack_for_cpu(w_int, 1)
            qsz = torch.rand(2048 // 128, 6144, 2, dtype=torch.bfloat16, generator=generator)
            copies = [(packed_w.clone(), qsz.clone()) for _ in range(COPIES)]
            kernels["torch `_weight_int4pack_mm_for_cpu`, group 128 (bf16 activations)"] = (
                [lambda x, p=p, q=q: torch._weight_int4pack_mm_for_cpu(x, p, 128, q) for p, q in copies],
                torch.bfloat16,
            )
        except (RuntimeError, AttributeError) as exc:
            print(f"torch's 4-bit CPU kernel is unavailable here: {exc}")
        return fastest_ms(kernels, inputs)


def served_in_a_cgroup(model_path, limit_mib: int, threads: int) -> dict:
    """Gunicorn on `model_path` inside a memory cgroup: PSS once ready, 30 picture-conversation
    requests, the cgroup's peak and OOM kills (what a 2 GiB container would see)."""
    with tempfile.TemporaryDirectory() as logs, memory_cgroup(limit_mib * 1024**2) as cgroup:
        env = {"MODEL_PATH": str(model_path), "THREADS": str(threads)}
        with gunicorn_server(env, Path(logs) / "gunicorn.log", timeout=900, preexec_fn=cgroup.enter) as (base, proc):
            ready_pss = tree_memory(proc)
            statuses = picture_conversations(base)
            after_pss = tree_memory(proc)
        return {
            "ready_pss_gib": ready_pss / 1024**3,
            "after_pss_gib": after_pss / 1024**3,
            "served": statuses.count(200),
            "failures": [s for s in statuses if s != 200],
            "peak_gib": cgroup.peak_bytes() / 1024**3,
            "oom_kills": cgroup.oom_kills(),
        }


def main(argv=None) -> int:
    p = parser(__doc__, quantization=False)
    p.add_argument("--memory", action="store_true", help="also serve the 4-bit and INT8 checkpoints in a cgroup")
    p.add_argument("--memory-only", action="store_true", help="only that")
    p.add_argument("--cgroup-mib", type=int, default=2048)
    args = parse(p, argv, source=True)
    source = args.model_path
    sections = []
    if not args.memory_only:
        sections.append(("4-bit weights: group size, zero point and kernel", choice_tables(source, args.threads)))
    if args.memory or args.memory_only:
        sections.append(
            (f"4-bit weights: memory, served in a {args.cgroup_mib} MiB cgroup", memory_table(source, args))
        )
    for title, body in sections:
        settings = {
            "weights": source.name,
            "threads": args.threads,
            "copies cycled": COPIES,
            "torch": torch.__version__,
        }
        report(args, title, settings, body)
    return 0


def memory_table(source, args) -> str:
    rows = []
    for suffix in ("-int4", "-int8"):
        path = source.with_name(source.name + suffix)
        r = served_in_a_cgroup(path, args.cgroup_mib, args.threads)
        rows.append(
            [
                path.name,
                f"{r['ready_pss_gib']:.2f}",
                f"{r['after_pss_gib']:.2f}",
                f"{r['served']}/30" + (f" (statuses {sorted(set(r['failures']))})" if r["failures"] else ""),
                f"{r['peak_gib']:.2f}",
                r["oom_kills"],
            ]
        )
    return markdown_table(
        [
            "checkpoint",
            "resident once ready (PSS, GiB)",
            "after the 30 requests (PSS, GiB)",
            "answered",
            f"cgroup peak (GiB, limit {args.cgroup_mib / 1024:.1f})",
            "OOM kills",
        ],
        rows,
    ) + (
        "\n\nGunicorn (master + one worker, preloaded) with the service's defaults and no MAX_MEMORY_MB: the budget "
        "follows the cgroup's limit. 10 conversations × 3 turns, the first with a ~448×448 JPEG, 16 tokens each."
    )


def choice_tables(source, threads: int) -> str:
    errors = weight_errors(source)
    bytes_per_weight = {g: 0.5 + 3 / g for g in GROUPS}  # a u4 value, and per group an fp16 scale and a u8 zero point
    error_table = markdown_table(
        [
            "group size",
            "zero point",
            "bytes per weight",
            "decoder weights: relative error",
            "vision weights: relative error",
        ],
        [
            [
                g,
                "8 (symmetric)" if sym else "per group",
                f"{bytes_per_weight[g]:.3f}",
                f"{errors[g, sym]['decoder']:.4f}",
                f"{errors[g, sym]['vision']:.4f}",
            ]
            for g in GROUPS
            for sym in (False, True)
        ],
    )
    times = kernel_times(threads)
    int8 = times["INT8 native (per-row activations)"]
    kernel_table = markdown_table(
        [
            "kernel, one 2048 → 6144 layer from DRAM",
            *[f"{m} rows (ms)" for m in ROWS],
            "1 row vs INT8",
            "218 rows vs INT8",
        ],
        [[k, *[f"{t:.3f}" for t in v], f"{v[0] / int8[0]:.2f}×", f"{v[-1] / int8[-1]:.2f}×"] for k, v in times.items()],
    )
    return error_table + "\n\n" + kernel_table


if __name__ == "__main__":
    raise SystemExit(main())
