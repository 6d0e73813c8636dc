"""The Qwen3-VL vision tower on ONNX Runtime: export (fp32 + dynamic INT8), cache lookup, encoder.

The tower computes its rotary positions, position-embedding interpolation and attention segments
from `grid_thw` with Python loops and `.tolist()`, which do not trace. So the exported graph covers
ONE image and takes those grid-dependent tensors as inputs (`position_ids`, `interp_indices`,
`interp_weights`, made by transformers' own `vision_utils` helpers outside the graph); its only
dynamic dimension is the number of patches. One image per session run keeps attention within the
image, exactly like the torch path's per-image attention segments.

An export directory holds `vision_fp32.onnx` (+ `.data`), `vision_int8.onnx` and `manifest.json`,
which names the checkpoint it was made from (path, file sizes and mtimes) and `EXPORT_VERSION`; an
export whose manifest no longer matches is stale and is not used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .features import VisionFeatures

log = logging.getLogger(__name__)

# Bump when the graph's inputs, outputs or numerics change: older exports then count as stale.
EXPORT_VERSION = 1
MANIFEST = "manifest.json"
GRAPH_FILES = {"fp32": "vision_fp32.onnx", "int8": "vision_int8.onnx"}
# Opset 23 has the Attention operator: scaled_dot_product_attention exports as one node.
OPSET = 23
INPUT_NAMES = ["pixel_values", "position_ids", "interp_indices", "interp_weights"]


class StaleExport(Exception):
    """The export directory is missing, incomplete or made from another checkpoint or version."""


# -- which export belongs to which checkpoint ---------------------------------------------------


def checkpoint_key(model_dir: Path) -> str:
    """A hash of the checkpoint's identity: resolved path, and name, size and mtime of its config
    and weight files, plus EXPORT_VERSION. Changing any weight file changes the key."""
    model_dir = Path(model_dir).resolve()
    parts = [f"export-version={EXPORT_VERSION}", str(model_dir)]
    for f in sorted(model_dir.iterdir()):
        if f.name == "config.json" or f.suffix in (".safetensors", ".bin"):
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def default_export_dir(model_dir: Path, cache_dir: Path) -> Path:
    """Where the service looks for a checkpoint's export unless VISION_ONNX_DIR names one."""
    return Path(cache_dir) / "onnx-vision" / f"{Path(model_dir).resolve().name}-{checkpoint_key(model_dir)[:16]}"


def check_export(export_dir: Path, model_dir: Path) -> dict:
    """The manifest of a usable export of `model_dir`; raises StaleExport saying why not."""
    manifest_file = Path(export_dir) / MANIFEST
    if not manifest_file.is_file():
        raise StaleExport(f"no ONNX export in {export_dir}")
    manifest = json.loads(manifest_file.read_text())
    if manifest.get("export_version") != EXPORT_VERSION:
        raise StaleExport(
            f"{export_dir} holds export version {manifest.get('export_version')}, this service needs {EXPORT_VERSION}"
        )
    if manifest.get("checkpoint_key") != checkpoint_key(model_dir):
        raise StaleExport(
            f"{export_dir} was exported from {manifest.get('checkpoint_path')} as it was then, "
            f"not from {model_dir} as it is now"
        )
    missing = [name for name in GRAPH_FILES.values() if not (Path(export_dir) / name).is_file()]
    if missing:
        raise StaleExport(f"{export_dir} lacks {', '.join(missing)}")
    return manifest


# -- the graph ----------------------------------------------------------------------------------


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as `apply_rotary_pos_emb_vision` does it (x: tokens × heads × head_dim)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SingleImageVisionTower(nn.Module):
    """The model's vision tower for one image, with the grid-dependent tensors as inputs.

    Reuses the checkpoint's own modules (patch embedding, position table, blocks' norms, linears
    and MLPs, mergers); only the attention call is written out, as one full attention over the
    image's patches instead of the per-segment split that needs `.tolist()`.
    """

    def __init__(self, visual: nn.Module):
        super().__init__()
        self.visual = visual

    def _block(self, block: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn = block.attn
        n = h.shape[0]
        q, k, v = attn.qkv(block.norm1(h)).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=attn.scaling)
        h = h + attn.proj(out.squeeze(0).transpose(0, 1).reshape(n, -1))
        return h + block.mlp(block.norm2(h))

    def forward(self, pixel_values, position_ids, interp_indices, interp_weights):
        visual = self.visual
        # The patch embedding is a Conv3d whose kernel equals its stride: a matrix product on the
        # flattened patches, and ONNX Runtime's 3-D Conv is many times slower than its MatMul.
        proj = visual.patch_embed.proj
        h = F.linear(pixel_values, proj.weight.reshape(proj.out_channels, -1), proj.bias)
        h = h + (visual.pos_embed(interp_indices) * interp_weights[:, :, None]).sum(1)
        cos, sin = visual.rotary_pos_emb(h, position_ids)
        deepstack = []
        for index, block in enumerate(visual.blocks):
            h = self._block(block, h, cos, sin)
            if index in visual.deepstack_visual_indexes:
                merger = visual.deepstack_merger_list[visual.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(h))
        return (visual.merger(h), *deepstack)


def grid_inputs(grid_thw: torch.Tensor, spatial_merge_size: int, num_grid_per_side: int) -> dict[str, np.ndarray]:
    """The graph's grid-dependent inputs for one image (`grid_thw`: 1 × 3), computed exactly as
    the torch tower computes them (transformers' `vision_utils`)."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    position_ids = get_vision_position_ids(grid_thw, spatial_merge_size)
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid_thw,
        num_grid_per_side=num_grid_per_side,
        mode="bilinear",
        align_corners=True,
        spatial_merge_size=spatial_merge_size,
    )
    return {
        "position_ids": position_ids.numpy().astype(np.int64),
        "interp_indices": indices.numpy().astype(np.int64),
        "interp_weights": weights.numpy().astype(np.float32),
    }


# -- export ---------------------------------------------------------------------------------------


def _load_visual(model_dir: Path) -> tuple[nn.Module, object]:
    """The checkpoint's vision tower alone in fp32 (bf16 → fp32 is exact): built from its config (the
    dense family's class or the mixture of experts') and given only the tower's tensors, read from the
    safetensors files — not the decoder, which for 30B-A3B would be 61 GB in bf16."""
    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    config = AutoConfig.from_pretrained(model_dir)
    tower = Qwen3VLMoeVisionModel if config.model_type == "qwen3_vl_moe" else Qwen3VLVisionModel
    visual = tower._from_config(config.vision_config, dtype=torch.float32)
    state = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                for prefix in ("model.visual.", "visual."):  # transformers 5's names, and the releases' older ones
                    if name.startswith(prefix):
                        state[name.removeprefix(prefix)] = f.get_tensor(name).float()
    visual.load_state_dict(state, strict=True)
    visual.eval().requires_grad_(False)
    return visual, config.vision_config


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextmanager
def _quiet_exporters():
    """Silence the exporter's and quantizer's advice for other setups (torchvision ops it skips,
    deprecations inside torch, "consider pre-processing") while keeping real errors."""
    noisy = [logging.getLogger("torch.onnx._internal.exporter._registration"), logging.getLogger()]
    drop = _ErrorsOnly()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message=".*axis name.*will not be used")
        for logger in noisy:
            logger.addFilter(drop)
        try:
            yield
        finally:
            for logger in noisy:
                logger.removeFilter(drop)


def _example_inputs(config) -> tuple[torch.Tensor, ...]:
    """Tracing inputs for a 64 × 48-patch image (not square, so no dimension is special-cased)."""
    m = config.spatial_merge_size
    grid = torch.tensor([[1, 4 * m * 8, 3 * m * 8]])
    grid_tensors = grid_inputs(grid, m, int(config.num_position_embeddings**0.5))
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    return (torch.randn(int(grid.prod()), patch_dim), *(torch.from_numpy(grid_tensors[n]) for n in INPUT_NAMES[1:]))


EXPORT_STEPS = ["load the checkpoint", "export fp32", "quantize int8", "install"]


def export_vision_onnx(
    model_dir: Path, out_dir: Path, progress: Callable[[str], None] = lambda step: None, per_channel: bool = True
) -> dict:
    """Export `model_dir`'s vision tower to `out_dir`: the fp32 graph, then its dynamic-INT8 copy
    (`per_channel` weight scales), then the manifest. `out_dir` is replaced atomically, so a
    crashed export leaves no half-written directory. `progress(step)` is called as each step of
    EXPORT_STEPS ends. Returns the manifest."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from ..quant.packing import quantized_marker

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if quantized_marker(model_dir):
        raise ValueError(
            f"{model_dir} is a pre-quantized INT8 checkpoint (`quantize`): the export needs the "
            "float weights, so export an ordinary bf16 or fp32 checkpoint"
        )
    started = time.perf_counter()
    visual, config = _load_visual(model_dir)
    progress(EXPORT_STEPS[0])

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        patches = torch.export.Dim("patches", min=4)
        fp32_path = staging / GRAPH_FILES["fp32"]
        output_names = ["pooler"] + [f"deepstack_{i}" for i in range(len(config.deepstack_visual_indexes))]
        with torch.no_grad(), _quiet_exporters():
            program = torch.onnx.export(
                SingleImageVisionTower(visual).eval(),
                _example_inputs(config),
                input_names=INPUT_NAMES,
                output_names=output_names,
                dynamic_shapes={name: {0: patches} for name in INPUT_NAMES},
                dynamo=True,
                opset_version=OPSET,
                optimize=True,
                verbose=False,
            )
        program.save(str(fp32_path), external_data=True)  # fp32 weights of a 2B model pass protobuf's 2 GB
        del program, visual
        progress(EXPORT_STEPS[1])

        # Linear layers only (MatMul/Gemm): the patch embedding, norms and attention stay fp32,
        # as in the torch INT8 path.
        with _quiet_exporters():
            quantize_dynamic(
                fp32_path,
                staging / GRAPH_FILES["int8"],
                op_types_to_quantize=["MatMul"],
                per_channel=per_channel,
                weight_type=QuantType.QInt8,
            )
        progress(EXPORT_STEPS[2])

        manifest = {
            "export_version": EXPORT_VERSION,
            "checkpoint_path": str(model_dir.resolve()),
            "checkpoint_key": checkpoint_key(model_dir),
            "files": GRAPH_FILES,
            "spatial_merge_size": config.spatial_merge_size,
            "num_grid_per_side": int(config.num_position_embeddings**0.5),
            "deepstack_layers": len(config.deepstack_visual_indexes),
            "int8_per_channel": per_channel,
            "opset": OPSET,
            "torch": torch.__version__,
            "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "export_seconds": round(time.perf_counter() - started, 1),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        staging.chmod(0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
        progress(EXPORT_STEPS[3])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


# -- the encoder --------------------------------------------------------------------------------


class OnnxVisionEncoder:
    """The exported tower on ONNX Runtime; same call as TorchVisionEncoder, one session run per image."""

    name = "onnxruntime"

    def __init__(self, export_dir: Path, precision: str, threads: int, manifest: dict | None = None):
        import onnxruntime as ort

        self.export_dir = Path(export_dir)
        self.precision = precision
        self.manifest = manifest or json.loads((self.export_dir / MANIFEST).read_text())
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = ort.InferenceSession(
            str(self.export_dir / GRAPH_FILES[precision]), options, providers=["CPUExecutionProvider"]
        )
        self._session = session
        self._output_names = [o.name for o in session.get_outputs()]

    def __call__(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[VisionFeatures]:
        features = []
        for patches, (_, h, w) in zip(
            torch.split(pixel_values, image_grid_thw.prod(-1).tolist()), image_grid_thw.tolist()
        ):
            # Frames attend only within themselves (the torch tower's attention segments): one run each.
            frames = [self._run(frame, h, w) for frame in torch.split(patches, h * w)]
            features.append(VisionFeatures.cat([VisionFeatures(pooler=f[0], deepstack=f[1:]) for f in frames]))
        return features

    def _run(self, patches: torch.Tensor, h: int, w: int) -> list[torch.Tensor]:
        feeds = grid_inputs(
            torch.tensor([[1, h, w]]), self.manifest["spatial_merge_size"], self.manifest["num_grid_per_side"]
        )
        feeds["pixel_values"] = patches.to(torch.float32).numpy()
        return [torch.from_numpy(out) for out in self._session.run(self._output_names, feeds)]


def load_onnx_encoder(model_dir: Path, settings) -> OnnxVisionEncoder | None:
    """The ONNX encoder for `model_dir` in the precision QUANTIZATION names, from VISION_ONNX_DIR
    or the cache; None (with a warning saying how to build it) if that export is missing or stale."""
    export_dir = settings.vision_onnx_dir or default_export_dir(model_dir, settings.cache_dir)
    try:
        manifest = check_export(export_dir, model_dir)
    except StaleExport as exc:
        log.warning(
            "VISION_BACKEND=onnxruntime, but %s: using the torch vision encoder. Build the export "
            "with `python -m service export-onnx %s`.",
            exc,
            model_dir,
        )
        return None
    encoder = OnnxVisionEncoder(export_dir, settings.quantization, settings.threads, manifest)
    log.info("vision encoder: ONNX Runtime %s graph from %s", settings.quantization, export_dir)
    return encoder
