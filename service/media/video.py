"""Video clips → sampled RGB frames, and frames → what Qwen3-VL takes for a video.

transformers' own video processor needs torchvision (not installable beside this torch), so its
rules are reproduced here and checked against its source in tests/test_video.py:
- sampling (`Qwen3VLVideoProcessor.sample_frames`): `fps` frames per second of the clip, at least
  `min_frames`, at most `max_frames`, spread evenly from the first frame to the last;
- an odd count is padded with the last frame (what `patchify` does), so frames pair up into
  temporal patches of 2;
- size (`smart_resize`): sides multiples of patch × merge (32), here with a pixel budget per frame
  that keeps the whole clip within VIDEO_MAX_VISUAL_TOKENS;
- resize (torchvision's `resize`, which on the CPU runs torch's antialiased bicubic on the uint8
  frames themselves — not Pillow's, which pictures get: the two differ, by up to 23 levels on a noisy
  frame whose rows shrink while its columns grow);
- rescale and normalize fused (`TorchvisionBackend.rescale_and_normalize`), in float32;
- layout (`patchify`): pixel_values_videos is (groups·h·w) × (C·2·16·16), video_grid_thw (t, h, w);
- prompt (`Qwen3VLProcessor.replace_video_token`, `_calculate_timestamps`): per temporal patch
  `<{t:.1f} seconds><|vision_start|>` + its pads + `<|vision_end|>`, t the mean time of its frames.

Decoding order, for safety: size of the bytes → container from the magic bytes (only MP4/MOV,
WebM/Matroska and AVI reach FFmpeg: no playlists or other demuxers that open further files) →
duration, frame count and frame size from the container's metadata → decode only up to the last
sampled frame. OpenCV reads from a path, so the bytes go to a temporary file removed on every path.
"""

from __future__ import annotations

import hashlib
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import cv2
import numpy as np
import torch

from ..errors import TooLarge, VideoError
from .images import ImageLimits, checked_upload, fit_to_budget, to_rgb8

TEMP_PREFIX = "qwen3vl-video-"


@dataclass(frozen=True)
class VideoLimits:
    max_bytes: int
    max_seconds: float
    max_source_pixels: int  # width × height of the clip's frames as stored
    max_source_frames: int  # frames in the clip: all are decoded, so this bounds the work
    fps: float  # frames sampled per second of video
    max_frames: int  # frames sampled at most
    max_visual_tokens: int  # the whole clip's tokens in the prompt
    max_frame_pixels: int  # no frame larger than an image would be
    min_frames: int = 4  # the processor's minimum (fewer only when the clip has fewer)
    factor: int = 32  # patch size × merge size
    temporal_patch: int = 2

    @classmethod
    def from_settings(cls, settings, image_limits: ImageLimits, temporal_patch: int) -> VideoLimits:
        return cls(
            max_bytes=settings.video_max_bytes,
            max_seconds=settings.video_max_seconds,
            max_source_pixels=settings.video_max_source_pixels,
            max_source_frames=settings.video_max_source_frames,
            fps=settings.video_fps,
            max_frames=settings.video_max_frames,
            max_visual_tokens=settings.video_max_visual_tokens,
            max_frame_pixels=image_limits.max_pixels,
            factor=image_limits.factor,
            temporal_patch=temporal_patch,
        )

    def with_sampling(self, fps: float | None, max_frames: int | None) -> VideoLimits:
        """These limits with a request's own sampling rate and frame cap (None: the server's)."""
        return replace(
            self,
            fps=self.fps if fps is None else fps,
            max_frames=self.max_frames if max_frames is None else max_frames,
        )


@dataclass(frozen=True)
class DecodedVideo:
    """Sampled frames already at the size the encoder takes, with where they came from in the clip."""

    frames: np.ndarray  # T × H × W × 3 RGB uint8; T a multiple of the temporal patch (last frame repeated)
    frame_indices: tuple[int, ...]  # source frame number of each of `frames`
    source_fps: float
    source_format: str
    source_size: tuple[int, int]  # (width, height) as stored
    source_frames: int  # frame count from the container
    decode_seconds: float
    digest: str  # of the sampled, resized frames: the vision-feature cache key

    @property
    def size(self) -> tuple[int, int]:
        return self.frames.shape[2], self.frames.shape[1]

    @property
    def nbytes(self) -> int:
        return self.frames.nbytes

    @property
    def duration(self) -> float:
        return self.source_frames / self.source_fps

    def timestamps(self, temporal_patch: int = 2) -> list[float]:
        """Seconds shown before each temporal patch in the prompt."""
        return frame_timestamps(list(self.frame_indices), self.source_fps, temporal_patch)


def sniff_container(data: bytes) -> str | None:
    if data[4:8] == b"ftyp":
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":  # EBML: WebM and Matroska
        return "webm"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    return None


def sample_indices(total_frames: int, source_fps: float, limits: VideoLimits) -> list[int]:
    """Source frame numbers to keep: `Qwen3VLVideoProcessor.sample_frames` with fps = VIDEO_FPS."""
    wanted = int(total_frames / source_fps * limits.fps)
    count = min(max(wanted, limits.min_frames), limits.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, count).round().astype(int).tolist()


def frame_timestamps(indices: list[int], source_fps: float, temporal_patch: int = 2) -> list[float]:
    """`Qwen3VLProcessor._calculate_timestamps`: mean time of the first and last frame of each patch."""
    indices = list(indices)
    if len(indices) % temporal_patch:
        indices += [indices[-1]] * (temporal_patch - len(indices) % temporal_patch)
    seconds = [i / source_fps for i in indices]
    return [(seconds[i] + seconds[i + temporal_patch - 1]) / 2 for i in range(0, len(seconds), temporal_patch)]


def frame_size(width: int, height: int, num_frames: int, limits: VideoLimits) -> tuple[int, int]:
    """(width, height) of every sampled frame: the processor's resize rule with a per-frame budget
    that keeps all temporal patches together within `max_visual_tokens`."""
    groups = math.ceil(num_frames / limits.temporal_patch)
    tokens_per_frame = limits.max_visual_tokens // groups
    budget = min(tokens_per_frame * limits.factor**2, limits.max_frame_pixels)
    if budget < limits.factor**2:
        raise VideoError(f"{groups} frame pairs do not fit VIDEO_MAX_VISUAL_TOKENS={limits.max_visual_tokens}")
    if height < limits.factor or width < limits.factor:  # the video smart_resize scales such a side up first
        scale = max(limits.factor / height, limits.factor / width)
        width, height = int(width * scale), int(height * scale)
    w, h = fit_to_budget(
        width, height, ImageLimits(0, 0, max_pixels=budget, min_pixels=limits.factor**2, factor=limits.factor)
    )
    if (w // limits.factor) * (h // limits.factor) > tokens_per_frame:
        raise VideoError(f"a {width}x{height} video is too narrow for the visual-token budget")
    return w, h


def video_digest(frames: np.ndarray) -> str:
    """A clip's key in the vision-feature cache: a digest of its frames as the model sees them."""
    shape = repr(frames.shape).encode()
    return hashlib.blake2b(shape + frames.tobytes(), digest_size=16, person=b"qwen3vl-vid").hexdigest()


def decode_video(data: bytes, limits: VideoLimits, before_frames: Callable[[int], None] | None = None) -> DecodedVideo:
    """Bytes of an MP4/MOV, WebM/MKV or AVI clip → sampled RGB frames sized into the token budget.

    Raises VideoError (400) for empty, unknown, corrupt or frameless data and TooLarge (413) for
    bytes, duration or frame size beyond the limits — the latter from the metadata, before decoding.
    `before_frames` is called with the count of frames to be sampled once the container is read, before
    any frame is decoded: a request's own budget of frames may refuse the clip there.
    """
    start = time.perf_counter()
    fmt = checked_upload(data, "video", limits.max_bytes, sniff_container, VideoError, "MP4/MOV, WebM/MKV or AVI")
    with tempfile.NamedTemporaryFile(prefix=TEMP_PREFIX, suffix=f".{fmt}") as tmp:
        tmp.write(data)
        tmp.flush()
        capture = cv2.VideoCapture(tmp.name, cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, 1])
        try:
            frames, indices, meta = _read_frames(capture, fmt, limits, before_frames)
        finally:
            capture.release()
    frames = _pad_to_temporal_patch(frames, limits.temporal_patch)
    indices += [indices[-1]] * (len(frames) - len(indices))
    stacked = np.ascontiguousarray(np.stack(frames))
    return DecodedVideo(
        frames=stacked,
        frame_indices=tuple(indices),
        source_fps=meta["fps"],
        source_format=fmt,
        source_size=meta["size"],
        source_frames=meta["frames"],
        decode_seconds=time.perf_counter() - start,
        digest=video_digest(stacked),
    )


def _metadata(capture: cv2.VideoCapture, fmt: str, limits: VideoLimits) -> dict:
    """Frame rate, frame count and size from the container, checked against the limits."""
    if not capture.isOpened():
        raise VideoError(f"could not open the {fmt.upper()} video: truncated, corrupt or an unsupported codec")
    fps = capture.get(cv2.CAP_PROP_FPS)
    frames = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    width, height = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
    if width <= 0 or height <= 0:
        raise VideoError(f"the {fmt.upper()} video has no readable frame size")
    if width * height > limits.max_source_pixels:
        raise TooLarge(
            f"video frames are {width}x{height} = {width * height} pixels; the limit is {limits.max_source_pixels}",
            code="video_too_large",
        )
    if not 0 < fps <= 1000 or frames <= 0:
        raise VideoError(f"the {fmt.upper()} video gives no frame rate or frame count: truncated or corrupt")
    if frames / fps > limits.max_seconds:
        raise TooLarge(
            f"video is {frames / fps:.1f} s long; the limit is {limits.max_seconds:g} s", code="video_too_long"
        )
    if frames > limits.max_source_frames:
        raise TooLarge(f"video holds {frames} frames; the limit is {limits.max_source_frames}", code="video_too_long")
    return {"fps": fps, "frames": frames, "size": (width, height)}


def _read_frames(
    capture: cv2.VideoCapture, fmt: str, limits: VideoLimits, before_frames: Callable[[int], None] | None
) -> tuple[list[np.ndarray], list[int], dict]:
    """Decode in order up to the last sampled frame, keeping (resized) only the sampled ones."""
    meta = _metadata(capture, fmt, limits)
    wanted = sample_indices(meta["frames"], meta["fps"], limits)
    frame_size(*meta["size"], len(wanted), limits)  # refuse a clip that cannot fit before decoding it
    if before_frames is not None:
        before_frames(len(wanted))
    target = None  # from the first decoded frame: the decoder applies the clip's rotation
    frames, indices = [], []
    position, pending = 0, list(wanted)
    while pending and capture.grab():
        if pending[0] == position:
            ok, bgr = capture.retrieve()
            if not ok or bgr is None:
                raise VideoError(f"could not decode frame {position} of the {fmt.upper()} video: corrupt")
            if bgr.shape[0] * bgr.shape[1] > limits.max_source_pixels:
                raise TooLarge("a decoded frame is larger than the container says", code="video_too_large")
            target = target or frame_size(bgr.shape[1], bgr.shape[0], len(wanted), limits)
            frames.append(resize_frame(to_rgb8(bgr), target))
            indices.append(position)
            pending.pop(0)
        position += 1
    if not frames:
        raise VideoError(f"the {fmt.upper()} video holds no decodable frames")
    # Containers overstate their frame count by a frame or two at times; more is a cut or broken file.
    if pending and meta["frames"] - position > max(2, meta["frames"] // 50):
        raise VideoError(
            f"the {fmt.upper()} video is truncated or corrupt: its frames stop at "
            f"{position / meta['fps']:.1f} s of {meta['frames'] / meta['fps']:.1f} s"
        )
    return frames, indices, meta


def resize_frame(rgb: np.ndarray, target: tuple[int, int]) -> np.ndarray:
    """`rgb` (H × W × 3 uint8) at `target` (width, height) as transformers' video processor resizes a
    frame: torchvision's resize, on the CPU torch's antialiased bicubic on the uint8 frame itself."""
    if (rgb.shape[1], rgb.shape[0]) == target:
        return rgb
    frame = torch.from_numpy(rgb).permute(2, 0, 1)[None]
    resized = torch.nn.functional.interpolate(
        frame, size=[target[1], target[0]], mode="bicubic", align_corners=False, antialias=True
    )
    return resized[0].permute(1, 2, 0).numpy()


def _pad_to_temporal_patch(frames: list[np.ndarray], temporal_patch: int) -> list[np.ndarray]:
    return frames + [frames[-1]] * (-len(frames) % temporal_patch)


def video_patches(video: DecodedVideo, image_processor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values_videos, video_grid_thw) of one video, laid out as `Qwen3VLVideoProcessor.patchify`
    does, rescaled and normalized with the checkpoint's image processor settings."""
    ip = image_processor
    patch, merge, temporal = ip.patch_size, ip.merge_size, ip.temporal_patch_size
    # One step, as transformers' video processor fuses them: (x - mean / rescale) / (std / rescale).
    mean = torch.tensor(ip.image_mean) * (1.0 / ip.rescale_factor)
    std = torch.tensor(ip.image_std) * (1.0 / ip.rescale_factor)
    x = torch.from_numpy(video.frames).permute(0, 3, 1, 2).float()  # T × C × H × W
    x = (x - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
    frames, channels, height, width = x.shape
    if frames % temporal:  # decode_video pads to whole temporal patches
        raise ValueError(f"{frames} frames is not a whole number of {temporal}-frame temporal patches")
    t, h, w = frames // temporal, height // patch, width // patch
    x = x.view(t, temporal, channels, h // merge, merge, patch, w // merge, merge, patch)
    # → (t, h-blocks, w-blocks, merge rows, merge cols, C, temporal, patch rows, patch cols)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * h * w, channels * temporal * patch * patch)
    return x.contiguous(), torch.tensor([[t, h, w]])


def video_prompt_text(processor, grid_thw: torch.Tensor, timestamps: list[float]) -> str:
    """The tokens that stand for one video in the prompt (`Qwen3VLProcessor.replace_video_token`)."""
    t, h, w = (int(v) for v in grid_thw)
    pads = processor.video_token * (h * w // processor.image_processor.merge_size**2)
    return "".join(
        f"<{timestamps[i]:.1f} seconds>{processor.vision_start_token}{pads}{processor.vision_end_token}"
        for i in range(t)
    )
