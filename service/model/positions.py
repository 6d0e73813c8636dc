"""M-RoPE positions of a prompt: transformers' `Qwen3VLModel.get_rope_index`, without its model.

Text tokens advance all three axes (time, height, width) together; a picture's (or a video frame's)
placeholders take the grid of its merged patches from the position where it starts, and the text
after it resumes at that position plus the grid's larger side. A video is a run of one-frame grids
(its frames are separated by timestamps in the prompt). tests/test_skeleton.py compares it with
transformers' on pictures, clips and text.
"""

from __future__ import annotations

import itertools

import torch


def _grid_positions(start: int, grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """3 × (t·h·w / merge²) positions of one grid's merged patches, offset by `start`."""
    t, h, w = int(grid_thw[0]), int(grid_thw[1]) // merge, int(grid_thw[2]) // merge
    grid = torch.meshgrid(torch.arange(t), torch.arange(h) + start, torch.arange(w) + start, indexing="ij")
    positions = torch.stack(grid, dim=0).reshape(3, -1)
    positions[0] += start
    return positions


def rope_index(
    merge: int,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions 3 × batch × tokens, deltas batch × 1): each row's positions and how far its last
    position is from its length (every later token's position is its index plus the delta).
    `mm_token_type_ids`: 0 text, 1 picture placeholder, 2 video placeholder."""
    if video_grid_thw is not None:  # one grid per frame: timestamps separate a video's frames
        video_grid_thw = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
        video_grid_thw[:, 0] = 1
    grids = {
        1: iter(image_grid_thw) if image_grid_thw is not None else None,
        2: iter(video_grid_thw) if video_grid_thw is not None else None,
    }
    positions = torch.zeros(3, *input_ids.shape, dtype=input_ids.dtype)
    deltas = []
    for row, types in enumerate(mm_token_type_ids):
        parts, at = [], 0
        for kind, run in itertools.groupby(types.tolist()):
            if kind == 0:
                length = len(list(run))
                parts.append(torch.arange(length).view(1, -1).expand(3, -1) + at)
                at += length
            else:
                grid = next(grids[kind])
                parts.append(_grid_positions(at, grid, merge))
                at += int(max(grid[1], grid[2])) // merge
        row_positions = torch.cat(parts, dim=1).reshape(3, -1)
        positions[:, row] = row_positions
        deltas.append(row_positions.max() + 1 - input_ids.shape[1])
    return positions, torch.tensor(deltas).unsqueeze(1)
