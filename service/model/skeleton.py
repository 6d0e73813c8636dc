"""The modules that hold a Qwen3-VL checkpoint's weights as the service serves them, built by the
service itself: serving never imports transformers' modeling code (~5 s of every start).

Names and shapes are transformers' (`model.language_model.layers.3.self_attn.o_proj`, `model.visual.…`,
`lm_head`), with the projections the service fuses already fused (service/quant/fusion.py: q/k/v as
`qkv_proj`, gate/up as `gate_up_proj`, a mixture of experts' 3-D tensors as one gate/up and one down
Linear per expert), so a checkpoint's tensors load by name (service/model/weights.py) and the INT8
and 4-bit Linears replace the nn.Linears as they do in transformers' model. The computation is not
here: the text decoder's is service/model/forward.py's, the vision tower's service/vision/tower.py's.
tests/test_skeleton.py loads a checkpoint both ways and compares every tensor with transformers'.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn

from ..vision.tower import VisionTower
from .deltanet import Shape, is_hybrid

ACTIVATIONS = {"silu": nn.SiLU, "swish": nn.SiLU}  # transformers' ACT2FN: F.silu either way


def activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(f"text activation {name!r}: this service computes {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]()


def _linear(inputs: int, outputs: int, bias: bool = False) -> nn.Linear:
    return nn.Linear(inputs, outputs, bias=bias)


class Norm(nn.Module):
    """An RMSNorm's weight (the forward computes the norm with F.rms_norm)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.split_sizes = [
            config.num_attention_heads * self.head_dim,
            config.num_key_value_heads * self.head_dim,
            config.num_key_value_heads * self.head_dim,
        ]
        self.qkv_proj = _linear(config.hidden_size, sum(self.split_sizes), bias)
        self.o_proj = _linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias)
        self.q_norm = Norm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Norm(self.head_dim, config.rms_norm_eps)


class GatedAttention(nn.Module):
    """Qwen3.5's full attention: q_proj gives each head its query and an output gate side by side
    (fused here with k and v as `qkv_proj`: heads × (query, gate), then keys, then values)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.split_sizes = [
            2 * config.num_attention_heads * self.head_dim,
            config.num_key_value_heads * self.head_dim,
            config.num_key_value_heads * self.head_dim,
        ]
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = _linear(config.hidden_size, sum(self.split_sizes), bias)
        self.o_proj = _linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias)
        self.q_norm = Norm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Norm(self.head_dim, config.rms_norm_eps)


class _Tensor(nn.Module):
    """A module holding one `weight` (a checkpoint tensor the forward reads as it is)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape))


class LinearAttention(nn.Module):
    """Qwen3.5's Gated DeltaNet layer: its input projections (q, k, v and z side by side, the
    checkpoint's in_proj_qkv and in_proj_z; b and a, its in_proj_b and in_proj_a), the causal
    convolution's weights, the decay's parameters, the gated norm and out_proj
    (service/model/deltanet.py computes it)."""

    def __init__(self, config):
        super().__init__()
        shape = Shape.of(config)
        self.in_proj_qkvz = _linear(config.hidden_size, shape.conv_channels + shape.values)
        self.in_proj_ba = _linear(config.hidden_size, 2 * shape.value_heads)
        self.conv1d = _Tensor(shape.conv_channels, 1, shape.kernel)
        self.dt_bias = nn.Parameter(torch.zeros(shape.value_heads))
        self.A_log = nn.Parameter(torch.zeros(shape.value_heads))
        self.norm = Norm(shape.value_dim, config.rms_norm_eps)
        self.out_proj = _linear(shape.values, config.hidden_size)


class DenseMLP(nn.Module):
    def __init__(self, config, width: int):
        super().__init__()
        self.gate_up_proj = _linear(config.hidden_size, 2 * width)
        self.down_proj = _linear(width, config.hidden_size)
        self.act_fn = activation(config.hidden_act)


class Router(nn.Module):
    """A mixture of experts' router: a float matrix, experts × hidden (service/model/moe.py computes it)."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = getattr(config, "norm_topk_prob", True)
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))


class Experts(nn.Module):
    """Each expert's gate/up (hidden → 2·width, gate rows then up rows) and down Linears."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        width = config.moe_intermediate_size
        self.gate_up = nn.ModuleList(_linear(config.hidden_size, 2 * width) for _ in range(config.num_experts))
        self.down = nn.ModuleList(_linear(width, config.hidden_size) for _ in range(config.num_experts))
        self.act_fn = activation(config.hidden_act)


class SparseMLP(nn.Module):
    """Routed experts; Qwen3.5's add a shared expert, weighted by sigmoid(shared_expert_gate · x)."""

    def __init__(self, config):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        if shared:
            self.shared_expert = DenseMLP(config, shared)
            self.shared_expert_gate = _Tensor(1, config.hidden_size)  # a float row beside the router's


def is_sparse_layer(config, index: int) -> bool:
    """Whether decoder layer `index` is a mixture of experts (transformers' Qwen3VLMoe rule)."""
    experts = getattr(config, "num_experts", 0) or 0
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return experts > 0 and index not in (getattr(config, "mlp_only_layers", None) or []) and (index + 1) % step == 0


class DecoderLayer(nn.Module):
    def __init__(self, config, index: int):
        super().__init__()
        if not is_hybrid(config):
            self.self_attn = Attention(config, index)
        elif config.layer_types[index] == "linear_attention":
            self.linear_attn = LinearAttention(config)
        else:
            self.self_attn = GatedAttention(config, index)
        self.mlp = SparseMLP(config) if is_sparse_layer(config, index) else DenseMLP(config, config.intermediate_size)
        self.input_layernorm = Norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Norm(config.hidden_size, config.rms_norm_eps)


class Rotary(nn.Module):
    """M-RoPE's inverse frequencies (transformers' default rope), computed on the CPU even when the
    rest is built on the meta device: they are not in the checkpoint."""

    def __init__(self, config):
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r}: this service computes the default M-RoPE only")
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(dim * rope.get("partial_rotary_factor", 1.0))  # Qwen3.5 rotates a quarter of each head
        exponents = torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim
        self.register_buffer("inv_freq", 1.0 / (rope["rope_theta"] ** exponents), persistent=False)
        self.attention_scaling = 1.0
        self.mrope_section = rope.get("mrope_section", [24, 20, 20])


class TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, getattr(config, "pad_token_id", None))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Norm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Rotary(config)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens


def head_layers(config) -> int:
    """The decoder layers of the checkpoint's multi-token prediction head (Qwen3.5's `mtp.*`, its
    config's `mtp_num_hidden_layers`: 1 in every release); 0: none, or one with an embedding of its own
    (`mtp_use_dedicated_embeddings`, false in every release), which the service does not read."""
    text = getattr(config, "text_config", config)
    if not is_hybrid(text) or getattr(text, "mtp_use_dedicated_embeddings", False):
        return 0
    return int(getattr(text, "mtp_num_hidden_layers", 0) or 0)


class MultiTokenPrediction(nn.Module):
    """Qwen3.5's multi-token prediction head, as its checkpoints store it (`mtp.*`, vLLM's reading):
    `fc` over the normed embedding of the next token beside the normed hidden state the model left,
    one full-attention decoder layer, a final norm; the embedding and lm_head are the model's
    (service/model/mtp.py computes it)."""

    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.fc = _linear(2 * hidden, hidden)
        self.pre_fc_norm_embedding = Norm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = Norm(hidden, config.rms_norm_eps)
        full = config.layer_types.index("full_attention")  # a decoder layer of that kind, MLP as the model's
        self.layers = nn.ModuleList([DecoderLayer(config, full)])
        self.norm = Norm(hidden, config.rms_norm_eps)


class VisionLanguage(nn.Module):
    """transformers' `Qwen3VLModel` part: the vision tower, the text decoder, and the M-RoPE positions."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.visual = VisionTower(config.vision_config)
        self.language_model = TextModel(config.text_config)

    def get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None):
        from .positions import rope_index

        return rope_index(
            self.config.vision_config.spatial_merge_size, input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw
        )


class ServedModel(nn.Module):
    """transformers' `Qwen3VLForConditionalGeneration` (or its MoE twin) as far as serving reads it."""

    def __init__(self, config, mtp: bool = False):
        super().__init__()
        self.config = config
        self.generation_config = None  # the checkpoint's generation_config.json, set by the loader
        self.model = VisionLanguage(config)
        text = config.text_config
        self.lm_head = _linear(text.hidden_size, text.vocab_size)
        if tied_embeddings(config):
            self.lm_head.weight = self.model.language_model.embed_tokens.weight
        # the multi-token prediction head, when asked for and the config has one (the loaders drop it
        # when the checkpoint's files hold none of its tensors)
        self.mtp = MultiTokenPrediction(text) if mtp and head_layers(config) == 1 else None

    def get_input_embeddings(self) -> nn.Module:
        return self.model.language_model.get_input_embeddings()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, **_) -> Logits:
        """Every token's logits for one text-only prompt (1 × tokens), from a fresh cache: the service's
        forward (service/model/forward.py) in transformers' calling convention, for tools and tests."""
        from .attention import ExactAttention
        from .forward import Rows, TextForward

        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError("one prompt at a time: input_ids must be 1 × tokens")
        forward = TextForward(self, ExactAttention.load())  # made per call: modules may have been replaced
        ids = input_ids[0]
        cache = forward.new_cache(torch.float32)
        return Logits(forward(ids, torch.arange(len(ids)), [Rows(cache, len(ids))])[None])


class Logits(NamedTuple):
    logits: torch.Tensor  # 1 × tokens × vocabulary


def tied_embeddings(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


_INITIALIZED = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.Conv3d)
_building = threading.Lock()


@contextmanager
def _without_initialization():
    """torch's layers draw their initial weights in __init__; on the meta device that goes through
    torch's reference ops, whose first use imports torch._dynamo (seconds of a start) for values the
    checkpoint replaces anyway."""
    with _building:
        saved = {cls: cls.reset_parameters for cls in _INITIALIZED}
        for cls in _INITIALIZED:
            cls.reset_parameters = lambda self: None
        try:
            yield
        finally:
            for cls, reset in saved.items():
                cls.reset_parameters = reset


def skeleton(config, mtp: bool = False) -> ServedModel:
    """The model with every checkpoint tensor on the meta device (no memory): the loaders fill them;
    with `mtp`, the multi-token prediction head too, if the config has one."""
    with _without_initialization(), torch.device("meta"):
        return ServedModel(config, mtp)
