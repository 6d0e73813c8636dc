"""Random weights generated tensor by tensor: the one generator of `make-model`'s random checkpoints
(service/random_checkpoints/make.py), whether written as they are or straight into the INT8 / 4-bit format.

Every tensor is a pure function of its name and shape: it is generated in blocks along its first
dimension — one block per slice for tensors of three or more dimensions (one expert of a mixture of
experts' 3-D tensor, one output channel of the patch embedding), blocks of ⌈2²⁰ / row length⌉ rows
for matrices — each block drawn from N(0, initializer_range) with a torch generator seeded by a hash of
(SEED, the tensor's name, the block's index), then cast to the checkpoint's dtype. Norm weights are
ones and biases zeros, as transformers initialises them. So a tensor's values do not depend on
which tensors come before it, on the order they are written in, or on how a reader chunks it: any
rows can be generated alone, with at most one block (≤ 4 MiB in fp32) of scratch.

The embedded `tiny` model is the exception (`legacy_tensors`): it keeps the whole-model
`torch.manual_seed(0)` initialisation it always had, since the test suite runs on its weights.
"""

from __future__ import annotations

import hashlib
import math

import torch

SEED = 0
BLOCK_ELEMENTS = 1 << 20
# The releases store each layer's experts as [E, H, 2I] and [E, I, H]; transformers 5 holds (and saves) them
# transposed, its conversion mapping for qwen3_vl_moe turning them at load. The random checkpoints are
# generated in the releases' layout, so the tests load what a downloaded checkpoint holds.
RELEASED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _released(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.transpose(1, 2).contiguous() if name.endswith(RELEASED_EXPERTS) else tensor


def _block_seed(name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{SEED}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative 63-bit seed


def rows_per_block(shape: tuple[int, ...]) -> int:
    if len(shape) >= 3:
        return 1
    return max(1, BLOCK_ELEMENTS // math.prod(shape[1:]))


def generate(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, std: float, start: int = 0, stop: int | None = None
) -> torch.Tensor:
    """Rows [start, stop) (along the first dimension) of the random tensor `name` of `shape`."""
    stop = shape[0] if stop is None else min(stop, shape[0])
    if len(shape) == 1:  # norm weights (ones) and biases (zeros)
        return torch.full((stop - start,), 1.0 if name.endswith(".weight") else 0.0, dtype=dtype)
    out = torch.empty((stop - start, *shape[1:]), dtype=dtype)
    rows = rows_per_block(shape)
    for block in range(start // rows, -(-stop // rows)):
        first, last = block * rows, min(shape[0], (block + 1) * rows)
        generator = torch.Generator().manual_seed(_block_seed(name, block))
        values = torch.empty((last - first, *shape[1:])).normal_(0.0, std, generator=generator)
        lo, hi = max(first, start), min(last, stop)
        out[lo - start : hi - start] = values[lo - first : hi - first]
    return out


def checkpoint_shapes(config) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint of `config` stores, as the releases store them: the model's state dict
    (built on the meta device, Qwen3.5's MTP head included: service/quant/structure.py) without a tied
    lm_head, experts' 3-D tensors transposed (Qwen3-VL-MoE) or one expert's Linears apiece (Qwen3.5-MoE)."""
    from ..quant.structure import skeleton

    shapes = {n: tuple(t.shape) for n, t in skeleton(config).state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    per_expert = getattr(config, "model_type", None) == "qwen3_5_moe"
    for name, shape in list(shapes.items()):
        if name.endswith(RELEASED_EXPERTS) and per_expert:
            del shapes[name]
            shapes.update(_expert_linears(name.rpartition(".")[0], shape, name.endswith("gate_up_proj")))
        elif name.endswith(RELEASED_EXPERTS):
            shapes[name] = (shape[0], shape[2], shape[1])
    return dict(sorted(shapes.items()))


def _expert_linears(prefix: str, shape: tuple[int, ...], gate_up: bool) -> dict[str, tuple[int, ...]]:
    """A 3-D expert tensor (experts × out × in, transformers' layout) as each expert's own Linears."""
    experts, out, inputs = shape
    if gate_up:
        return {f"{prefix}.{e}.{p}_proj.weight": (out // 2, inputs) for e in range(experts) for p in ("gate", "up")}
    return {f"{prefix}.{e}.down_proj.weight": (out, inputs) for e in range(experts)}


class _Tensors:
    """What the quantized writer reads a checkpoint through (service/quant/source_tensors.py's
    `SourceTensors`): names, shapes, whole tensors and rows of one."""

    published: dict = {}  # no GPTQ/AWQ Linears

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype):
        self.shapes, self.dtype = shapes, dtype

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def nbytes(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values()) * self.dtype.itemsize

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        missing = [n for n in names if n not in self.shapes]
        if missing:
            raise KeyError(f"no tensors {missing[:3]} in this random checkpoint")
        return {n: self.read_rows(n, 0, self.shapes[n][0]) for n in names}

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError


class RandomTensors(_Tensors):
    """The random checkpoint of `config` in `dtype`, each tensor generated when read."""

    def __init__(self, config, dtype: torch.dtype):
        super().__init__(checkpoint_shapes(config), dtype)
        text = getattr(config, "text_config", config)
        vision = getattr(config, "vision_config", text)
        self.std = {"text": text.initializer_range, "vision": vision.initializer_range}
        self.centred_norms = "linear_attention" in (getattr(text, "layer_types", None) or [])

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        std = self.std["vision" if name.startswith("model.visual.") else "text"]
        if self.centred_norms and _is_centred_norm(name):  # 1 + weight: zeros are transformers' init
            return torch.zeros(min(stop, self.shapes[name][0]) - start, dtype=self.dtype)
        return generate(name, self.shapes[name], self.dtype, std, start, stop)


def _is_centred_norm(name: str) -> bool:
    """Qwen3.5's zero-centred RMSNorm weights: every text norm but the linear attention's gated one."""
    return not name.startswith("model.visual.") and name.endswith("norm.weight") and ".linear_attn." not in name


class ModelTensors(_Tensors):
    """Tensors already in memory (the embedded tiny model's, a few MB), released layout."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__({n: tuple(t.shape) for n, t in tensors.items()}, next(iter(tensors.values())).dtype)
        self.tensors = tensors

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name][start:stop]


def legacy_model(config, dtype: torch.dtype):
    """The whole model initialised by transformers after torch.manual_seed(0): the embedded tiny
    model's weights, as they have always been."""
    from ..quant.fusion import model_class

    torch.manual_seed(0)
    return model_class(config)._from_config(config, dtype=dtype)


def legacy_tensors(config, dtype: torch.dtype) -> ModelTensors:
    model = legacy_model(config, dtype)
    names = checkpoint_shapes(config)
    state = model.state_dict()
    return ModelTensors({n: _released(n, state[n].detach()) for n in names})
