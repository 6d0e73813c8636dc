"""Vision encoding in steps, so the batch scheduler can decode other sequences in between.

Each function is a generator: it yields after each unit of work and returns the features
(`VisionFeatures`) as its StopIteration value — drive it with `yield from` or `run_to_end`.
The torch tower is run one encoder block per step; it computes exactly what `get_image_features`
computes (same modules, same order). Other backends (ONNX Runtime) run an image in one step.
"""

from __future__ import annotations

from collections.abc import Generator

import torch
from transformers.vision_utils import (
    get_vision_attention_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
)

from .features import TorchVisionEncoder, VisionFeatures

Steps = Generator[None, None, VisionFeatures]


def run_to_end(steps: Steps) -> VisionFeatures:
    """Run a step generator without pausing; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def image_steps(encoder, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> Steps:
    """One image's features (`image_grid_thw` is 1 × 3)."""
    if not isinstance(encoder, TorchVisionEncoder):
        yield
        return encoder(pixel_values, image_grid_thw)[0]
    return (yield from _tower_steps(encoder.model.model.visual, pixel_values, image_grid_thw))


def video_steps(encoder, pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor) -> Steps:
    """One video's features, a temporal patch (frame pair) per encoder call: the vision tower attends
    within a temporal patch only, so this equals encoding the whole video at once."""
    t, h, w = (int(v) for v in video_grid_thw.reshape(-1))
    per_frame = h * w
    parts = []
    for i in range(t):
        parts.append(
            (
                yield from image_steps(
                    encoder, pixel_values_videos[i * per_frame : (i + 1) * per_frame], torch.tensor([[1, h, w]])
                )
            )
        )
    return VisionFeatures.cat(parts)


@torch.inference_mode()
def _tower_steps(visual, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Steps:
    """Qwen3VLVisionModel.forward for one image, pausing after the patch embedding and each block."""
    kwargs: dict = {}
    hidden = pixel_values.type(visual.dtype)
    interp_indices, interp_weights = get_vision_interpolation_indices_and_weights(
        grid_thw,
        num_grid_per_side=visual.num_grid_per_side,
        mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners,
        spatial_merge_size=visual.config.spatial_merge_size,
        kwargs=kwargs,
    )
    position_ids = get_vision_position_ids(grid_thw, visual.spatial_merge_size, kwargs=kwargs)
    cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid_thw, visual.config, kwargs=kwargs)
    hidden = visual.patch_embed(hidden)
    taps = visual.pos_embed(interp_indices) * interp_weights[:, :, None]
    pos_embeds = taps[:, 0]
    for tap in range(1, taps.shape[1]):  # the taps added in order (a reduction's order follows the CPU)
        pos_embeds = pos_embeds + taps[:, tap]
    hidden = hidden + pos_embeds.to(hidden.dtype)
    position_embeddings = visual.rotary_pos_emb(hidden, position_ids)
    hidden = hidden.reshape(hidden.shape[0], -1)
    deepstack = []
    for index, block in enumerate(visual.blocks):
        yield
        hidden = block(hidden, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, position_embeddings=position_embeddings)
        if index in visual.deepstack_visual_indexes:
            deepstack.append(visual.deepstack_merger_list[visual.deepstack_visual_indexes.index(index)](hidden))
    return VisionFeatures(pooler=visual.merger(hidden), deepstack=deepstack)
