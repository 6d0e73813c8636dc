"""An ordinary (unquantized) Qwen3-VL checkpoint's tensors into the service's skeleton
(service/model/skeleton.py), one tensor at a time, without transformers' `from_pretrained`.

The checkpoint's names are transformers'; the skeleton's fused projections take theirs side by side
(q, k, v rows into `qkv_proj`; gate, up rows into `gate_up_proj`), a mixture of experts' 3-D tensors
one expert at a time (transformers 5's layout, or transposed as the releases store them), and a tied
`lm_head` is the embedding. Tensors keep the checkpoint's dtype unless `dtype` says otherwise.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from torch import nn

from ..quant.packing import FUSED_PROJECTIONS
from ..quant.structure import drop_absent_head
from .skeleton import ServedModel, tied_embeddings

log = logging.getLogger(__name__)

_DECODER_LAYER = r"(?:model\.language_model|mtp)\.layers\.\d+"  # the model's, or its MTP head's (Qwen3.5)
_LAYER = re.compile(rf"^({_DECODER_LAYER})\.(.+)\.(weight|bias)$")
_EXPERTS = re.compile(rf"^({_DECODER_LAYER}\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# an expert stored as its own Linears (Qwen3.5-MoE's releases): gate and up rows into its `gate_up`
_EXPERT = re.compile(rf"^({_DECODER_LAYER}\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _files(path: Path) -> dict[str, str]:
    """Tensor name → safetensors file name."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no safetensors weights")
    names = {}
    for file in files:
        with safe_open(file, "pt") as f:
            names.update(dict.fromkeys(f.keys(), file.name))
    return names


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    parent, _, attr = name.rpartition(".")
    module = model.get_submodule(parent)
    expected = getattr(module, attr)
    if tuple(expected.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} in the checkpoint, {tuple(expected.shape)} expected")
    module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)


def _target(name: str) -> tuple[str, int, int] | None:
    """For a checkpoint tensor that is part of a fused Linear: (fused tensor, part index, parts)."""
    expert = _EXPERT.match(name)
    if expert is not None:
        prefix, index, part = expert.groups()
        if part == "down":
            return f"{prefix}.down.{index}.weight", 0, 1
        return f"{prefix}.gate_up.{index}.weight", ("gate", "up").index(part), 2
    match = _LAYER.match(name)
    if not match:
        return None
    layer, module, kind = match.groups()
    for fused, parts in FUSED_PROJECTIONS.items():
        if module in parts:
            return f"{layer}.{fused}.{kind}", parts.index(module), len(parts)
    return None


def load_weights(model: ServedModel, path: Path, dtype: torch.dtype | None = None) -> None:
    """Fill every tensor of the meta `model` from the checkpoint at `path` (in `dtype`, or as stored)."""
    from safetensors import safe_open

    path = Path(path)
    file_of = _files(path)
    pending: dict[str, dict[int, torch.Tensor]] = {}  # fused tensor → its parts read so far
    ignored = []
    for file in sorted(set(file_of.values())):
        with safe_open(path / file, "pt") as f:
            for name in f.keys():
                if name.startswith("mtp.") and getattr(model, "mtp", None) is None:
                    continue  # Qwen3.5's multi-token prediction head, not loaded (MTP_DRAFTING=off)
                tensor = f.get_tensor(name)
                if dtype is not None:
                    tensor = tensor.to(dtype)
                fused = _target(name)
                experts = _EXPERTS.match(name)
                if fused is not None:
                    target, index, count = fused
                    parts = pending.setdefault(target, {})
                    parts[index] = tensor
                    if len(parts) == count:
                        _assign(model, target, torch.cat([parts[i] for i in range(count)]))
                        del pending[target]
                elif experts is not None:
                    _assign_experts(model, experts[1], experts[2], tensor)
                elif name == "lm_head.weight" and tied_embeddings(model.config):
                    continue  # the embedding is the lm_head
                else:
                    try:
                        model.get_parameter(name)
                    except AttributeError:
                        ignored.append(name)
                        continue
                    _assign(model, name, tensor)
    if pending:
        raise ValueError(f"{path} is incomplete: parts of {sorted(pending)[:3]} are missing")
    if ignored:  # another architecture's, or a damaged file: never served half understood
        raise ValueError(
            f"{path} has {len(ignored)} tensors this service does not know for its config "
            f"({model.config.model_type}): {', '.join(sorted(ignored)[:5])}"
        )
    if tied_embeddings(model.config):
        model.lm_head.weight = model.model.language_model.embed_tokens.weight
    drop_absent_head(model)
    missing = [n for n, t in model.named_parameters() if t.is_meta]
    if missing:
        raise ValueError(f"{path} is incomplete: no weights for {missing[:3]} (and {max(0, len(missing) - 3)} more)")


def _assign_experts(model: nn.Module, prefix: str, tensor_name: str, tensor: torch.Tensor) -> None:
    """A layer's 3-D expert tensor (experts × out × in, or experts × in × out) as one Linear per expert."""
    part = "gate_up" if tensor_name == "gate_up_proj" else "down"
    linears = model.get_submodule(f"{prefix}.{part}")
    expected = tuple(linears[0].weight.shape)
    turned = tuple(tensor.shape[1:]) != expected
    if len(linears) != tensor.shape[0] or (turned and tuple(tensor.shape[1:][::-1]) != expected):
        raise ValueError(f"{prefix}.{tensor_name}: shape {tuple(tensor.shape)}, {len(linears)} × {expected} expected")
    for e, linear in enumerate(linears):
        weight = tensor[e].t() if turned else tensor[e]
        linear._parameters["weight"] = nn.Parameter(weight.contiguous(), requires_grad=False)


def generation_config(path: Path, config):
    """The checkpoint's generation_config.json, or the defaults its config implies (as `from_pretrained`)."""
    from transformers import GenerationConfig

    if (Path(path) / "generation_config.json").exists():
        return GenerationConfig.from_pretrained(path)
    return GenerationConfig.from_model_config(config)
