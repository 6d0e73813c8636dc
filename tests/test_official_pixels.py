"""The pixels the model sees, bit for bit against transformers' own processors given the same decoded RGB.

Pictures: the service decodes, sizes and patchifies (decode_image, the engine's prompt); the reference
is `Qwen2VLImageProcessorPil` (the Qwen2-VL / Qwen3-VL image processor's Pillow backend, what
transformers builds without torchvision) with the request's pixel budget as its `size`.

Clip frames: the reference is `Qwen3VLVideoProcessor` (its resize rule, fused rescale and normalize,
patchify) on the sampled frames at their decoded size. It calls three torchvision functions, and
torchvision cannot be imported beside this torch: `torchvision_stand_in` gives it their code for what
it runs here (uint8 frames on the CPU), copied from torchvision 0.28.
"""

from __future__ import annotations

import enum
import io
import math
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import torch
import transformers.image_processing_backends
import transformers.video_processing_utils
from PIL import Image
from transformers.image_utils import PILImageResampling
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from service.engine.engine import GenerationRequest
from service.media.images import decode_image
from service.media.video import decode_video
from service.model.prompts import ChatMessage, ImagePart, TextPart, VideoPart

from clips import noise, write_clip
from conftest import prepared
from imaging import encode, pattern, with_exif_orientation


def noisy(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A BGR picture whose every pixel differs from its neighbours (any resampling difference shows),
    over the test pattern's structure."""
    rng = np.random.default_rng(seed)
    picture = pattern(width, height, seed=seed).astype(np.int16) + rng.integers(-40, 41, (height, width, 3))
    return np.clip(picture, 0, 255).astype(np.uint8)


def reference_rgb(data: bytes, ext: str) -> np.ndarray:
    """The picture as decoded before any resize: PNG by Pillow (lossless: the same RGB whoever decodes),
    JPEG by OpenCV in full (EXIF orientation applied), as the service decodes it."""
    if ext == ".png":
        return np.array(Image.open(io.BytesIO(data)).convert("RGB"))
    return cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)


def the_models_pixels(engine, part) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel values, grid) the engine's prompt hands the model for one picture or clip."""
    prompt = prepared(engine, GenerationRequest([ChatMessage("user", [part, TextPart("What is it?")])]))
    if isinstance(part, ImagePart):
        return prompt.pixel_values[0], prompt.image_grid_thw
    return prompt.pixel_values_videos[0], prompt.video_grid_thw


def transformers_pixels(checkpoint, rgb: np.ndarray, limits) -> dict:
    """The checkpoint's image processor in transformers, the request's budget as its size."""
    return Qwen2VLImageProcessorPil.from_pretrained(checkpoint)(
        images=[rgb], size={"shortest_edge": limits.min_pixels, "longest_edge": limits.max_pixels}, return_tensors="pt"
    )


def budgets(limits):
    """The picture budgets a request can give (native max_pixels / min_pixels, OpenAI's detail)."""
    return {
        "default": limits,
        "small": limits.with_budget(4096),  # below the checkpoint's own floor
        "ceiling": limits.with_budget(limits.ceiling),
        "floor": limits.with_floor(512 * 512),
        "tight": limits.with_budget(limits.factor**2),
    }


PICTURES = [  # (width, height, encoding, budget)
    (500, 360, ".png", "default"),  # 512 x 352: rows shrink, columns grow
    (1920, 1080, ".png", "default"),
    (1920, 1080, ".jpg", "ceiling"),
    (4000, 3000, ".jpg", "default"),  # a photo: 1/8 of its size and less
    (20, 20, ".png", "default"),  # scaled up to the checkpoint's floor
    (33, 17, ".png", "default"),
    (257, 255, ".png", "default"),
    (3000, 40, ".png", "default"),  # very wide
    (40, 2000, ".png", "default"),  # very tall
    (1000, 10, ".png", "default"),  # a side that rounds to nothing
    (640, 480, ".png", "small"),
    (640, 480, ".png", "tight"),
    (300, 200, ".jpg", "floor"),
    (1024, 1024, ".png", "ceiling"),  # already at its size: left as it is
]


@pytest.mark.parametrize("width,height,ext,budget", PICTURES, ids=lambda v: str(v))
def test_a_pictures_pixels_are_transformers_own(fp32_engine, tiny_dir, width, height, ext, budget):
    limits = budgets(fp32_engine.limits.image)[budget]
    data = encode(noisy(width, height), ext)
    pixels, grid = the_models_pixels(fp32_engine, ImagePart(decode_image(data, limits)))
    reference = transformers_pixels(tiny_dir, reference_rgb(data, ext), limits)
    assert torch.equal(grid, reference["image_grid_thw"])
    assert pixels.dtype == reference["pixel_values"].dtype and torch.equal(pixels, reference["pixel_values"])


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_an_exif_rotated_photos_pixels_are_transformers_own(fp32_engine, tiny_dir, orientation):
    limits = fp32_engine.limits.image
    data = with_exif_orientation(encode(noisy(3000, 2000), ".jpg"), orientation)
    pixels, grid = the_models_pixels(fp32_engine, ImagePart(decode_image(data, limits)))
    rgb = reference_rgb(data, ".jpg")
    assert rgb.shape[:2] == ((2000, 3000) if orientation == 3 else (3000, 2000))
    reference = transformers_pixels(tiny_dir, rgb, limits)
    assert torch.equal(grid, reference["image_grid_thw"]) and torch.equal(pixels, reference["pixel_values"])


class InterpolationMode(enum.Enum):
    """torchvision.transforms.v2.InterpolationMode, the members transformers names."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"


def resize_image(image, size, interpolation, antialias=True):
    """torchvision 0.28 `transforms.v2.functional.resize_image`, its path for uint8 bicubic on the
    CPU: interpolate on the uint8 tensor itself. (Its restriding of one channels-last image only
    chooses the output's memory layout.)"""
    assert interpolation is InterpolationMode.BICUBIC and image.dtype == torch.uint8 and image.device.type == "cpu"
    shape = image.shape
    channels, height, width = shape[-3:]
    if tuple(size) == (height, width):
        return image
    image = torch.nn.functional.interpolate(
        image.reshape(-1, channels, height, width),
        size=list(size),
        mode=interpolation.value,
        align_corners=False,
        antialias=antialias,
    )
    return image.reshape(shape[:-3] + (channels, *size))


def normalize_image(image, mean, std, inplace=False):
    """torchvision 0.28 `transforms.v2.functional.normalize_image`."""
    mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype, device=image.device).view(-1, 1, 1)
    image = image.sub_(mean) if inplace else image.sub(mean)
    return image.div_(std)


def grayscale_to_rgb(video):
    """torchvision 0.28 `grayscale_to_rgb_image` for frames already RGB (all that decode_video gives)."""
    assert video.shape[-3] == 3
    return video


@pytest.fixture
def torchvision_stand_in(monkeypatch):
    tvF = SimpleNamespace(
        InterpolationMode=InterpolationMode,
        resize=resize_image,
        normalize=normalize_image,
        grayscale_to_rgb=grayscale_to_rgb,
    )
    for module in (transformers.image_processing_backends, transformers.video_processing_utils):
        monkeypatch.setattr(module, "tvF", tvF, raising=False)
    monkeypatch.setattr(
        transformers.image_processing_backends,
        "pil_torch_interpolation_mapping",
        {PILImageResampling.BICUBIC: InterpolationMode.BICUBIC},
    )


def decoded_frames(path, indices) -> np.ndarray:
    """The clip's frames `indices` (repeats included) as OpenCV decodes them, RGB, not resized."""
    capture = cv2.VideoCapture(str(path), cv2.CAP_FFMPEG)
    frames = []
    while (ok := capture.read())[0]:
        frames.append(cv2.cvtColor(ok[1], cv2.COLOR_BGR2RGB))
    capture.release()
    return np.stack([frames[i] for i in indices])


CLIPS = [  # (width, height, frames, fps)
    (500, 360, 40, 10.0),  # rows shrink, columns grow
    (640, 480, 60, 10.0),
    (1280, 720, 20, 10.0),
    (160, 120, 40, 10.0),  # grows
    (40, 24, 20, 10.0),  # a side below 32: transformers scales it up first
    (96, 400, 30, 10.0),  # tall
    (480, 64, 45, 10.0),  # wide; 9 frames sampled, the last repeated
]


@pytest.mark.parametrize("width,height,frames,fps", CLIPS, ids=lambda v: str(v))
def test_clip_frames_pixels_are_transformers_own(
    fp32_engine, tmp_path, torchvision_stand_in, width, height, frames, fps
):
    engine, ip = fp32_engine, fp32_engine.processor.image_processor
    path = tmp_path / "clip.avi"
    video = decode_video(
        write_clip(path, frames=frames, fps=fps, size=(width, height), frame=noise), engine.limits.video
    )
    pixels, grid = the_models_pixels(engine, VideoPart(video))
    limits, factor = engine.limits.video, ip.patch_size * ip.merge_size
    count = len(video.frame_indices)  # sampled frames, the last repeated to whole temporal patches
    per_frame = min(limits.max_visual_tokens // math.ceil(count / 2) * factor**2, limits.max_frame_pixels)
    reference = Qwen3VLVideoProcessor(
        patch_size=ip.patch_size,
        merge_size=ip.merge_size,
        temporal_patch_size=ip.temporal_patch_size,
        rescale_factor=ip.rescale_factor,
        image_mean=list(ip.image_mean),
        image_std=list(ip.image_std),
        size={"shortest_edge": count * factor**2, "longest_edge": count * per_frame},
    )(
        videos=[decoded_frames(path, video.frame_indices)],
        do_sample_frames=False,
        cap_pixels_per_frame=False,
        return_tensors="pt",
    )
    assert torch.equal(grid, reference["video_grid_thw"])
    assert torch.equal(pixels, reference["pixel_values_videos"])
