"""Video input: clips written with OpenCV, decoded, sampled and laid out as Qwen3-VL's processor would,
answered by the embedded tiny model through the engine and both HTTP endpoints."""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
from transformers.video_utils import VideoMetadata

from clips import WRITABLE, write_clip
from imaging import encode, pattern
from service.errors import TooLarge, VideoError
from service.video import (TEMP_PREFIX, DecodedVideo, VideoLimits, decode_video, encode_video, frame_size,
                           frame_timestamps, sample_indices, video_patches, video_prompt_text)
from service.vision import TorchVisionEncoder

LIMITS = VideoLimits(max_bytes=5 * 1024 * 1024, max_seconds=30, max_source_pixels=1920 * 1080, fps=2.0,
                     max_frames=32, max_visual_tokens=1024, max_frame_pixels=448 * 448)


@pytest.fixture(autouse=True)
def own_tempdir(tmp_path, monkeypatch):
    """Temporary files go to a directory of the test's own, so leftovers can be seen."""
    directory = tmp_path / "tmp"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    return directory


def leftovers(directory) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(TEMP_PREFIX)]


def still_video(image: np.ndarray, frames: int = 2) -> DecodedVideo:
    """A 'video' of one RGB image repeated, at 1 fps."""
    return DecodedVideo(frames=np.stack([image] * frames), frame_indices=tuple(range(frames)), source_fps=1.0,
                        source_format="test", source_size=(image.shape[1], image.shape[0]), source_frames=frames,
                        decode_seconds=0.0, digest="still")


# -- decoding and sampling --------------------------------------------------------------------------

@pytest.mark.parametrize("container", sorted(WRITABLE))
def test_clips_decode_to_frames_sampled_at_the_configured_rate(container, tmp_path, own_tempdir):
    data = write_clip(tmp_path / f"clip.{container}", frames=40, fps=10.0, size=(160, 120))
    video = decode_video(data, LIMITS)
    assert video.source_format == container
    assert video.source_fps == pytest.approx(10.0)
    assert video.source_frames == 40 and video.duration == pytest.approx(4.0)
    # 4 s at 2 frames per second, spread from the first frame to the last.
    assert video.frame_indices == (0, 6, 11, 17, 22, 28, 33, 39)
    assert video.frames.shape == (8, 128, 160, 3)  # 120 rounds to 128: sides are multiples of 32
    # The red square moves right: the sampled frames differ and keep their order.
    red = [np.argmax(f[:, :, 0].max(axis=0) > 200) for f in video.frames]
    assert red == sorted(red) and len(set(red)) == len(red)
    assert leftovers(own_tempdir) == []


def test_frame_count_and_visual_tokens_follow_the_settings(tmp_path):
    data = write_clip(tmp_path / "clip.avi", frames=100, fps=10.0, size=(640, 480))
    few = VideoLimits(**{**LIMITS.__dict__, "fps": 1.0, "max_frames": 6, "max_visual_tokens": 60})
    video = decode_video(data, few)
    assert len(video.frames) == 6  # 10 s at 1 fps, capped at 6
    patches, grid = video_patches(video, SimpleNamespace(patch_size=16, merge_size=2, temporal_patch_size=2,
                                                         rescale_factor=1 / 255, image_mean=[.5] * 3,
                                                         image_std=[.5] * 3))
    t, h, w = grid[0].tolist()
    assert t == 3 and t * h * w // 4 <= 60  # 3 frame pairs within 60 tokens
    assert video.size == (160, 96)  # the processor's rule rounds down into 20 tokens a pair: 15
    assert patches.shape == (t * h * w, 3 * 2 * 16 * 16)
    odd = decode_video(data, VideoLimits(**{**LIMITS.__dict__, "fps": 0.5}))
    assert odd.frame_indices == (0, 25, 50, 74, 99, 99)  # 5 frames: the last repeated to make pairs


def test_sampling_matches_the_processors_sample_frames():
    processor = Qwen3VLVideoProcessor()
    for total, fps, rate, cap in [(40, 10.0, 2.0, 32), (300, 30.0, 2.0, 32), (3000, 25.0, 2.0, 32),
                                  (7, 24.0, 2.0, 32), (2, 30.0, 2.0, 32), (120, 29.97, 1.0, 8), (1, 5.0, 2.0, 32)]:
        processor.max_frames = cap
        limits = VideoLimits(**{**LIMITS.__dict__, "fps": rate, "max_frames": cap})
        expected = processor.sample_frames(VideoMetadata(total_num_frames=total, fps=fps), fps=rate).tolist()
        assert sample_indices(total, fps, limits) == expected, (total, fps, rate, cap)


def test_timestamps_match_the_processors():
    for indices, fps in [([0, 6, 11, 17], 10.0), ([0, 25, 50, 74, 99], 29.97), ([0], 24.0), ([3, 9, 15], 7.5)]:
        assert frame_timestamps(indices, fps, 2) == Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)


def test_frame_size_is_the_processors_resize_rule_with_a_per_frame_budget():
    for width, height, frames in [(1920, 1080, 20), (160, 120, 8), (640, 480, 32), (1080, 1920, 4), (300, 37, 2),
                                  (4000, 100, 10)]:
        groups = frames // 2
        per_frame = min(LIMITS.max_visual_tokens // groups * 32 * 32, LIMITS.max_frame_pixels)
        h, w = smart_resize(frames, height, width, temporal_factor=2, factor=32, min_pixels=frames * 32 * 32,
                            max_pixels=frames * per_frame)
        assert frame_size(width, height, frames, LIMITS) == (w, h), (width, height, frames)
        assert groups * (h // 32) * (w // 32) <= LIMITS.max_visual_tokens


# -- what the model takes ---------------------------------------------------------------------------

def test_two_identical_frames_give_the_patches_of_one_image(fp32_engine):
    """The image processor duplicates an image in time; a still 'video' of two frames must match it."""
    ip = fp32_engine.processor.image_processor
    image = pattern(320, 256)[:, :, ::-1].copy()
    expected = ip(images=[image], return_tensors="pt")
    patches, grid = video_patches(still_video(image), ip)
    assert grid.tolist() == expected["image_grid_thw"].tolist() == [[1, 16, 20]]
    torch.testing.assert_close(patches, expected["pixel_values"].float(), rtol=0, atol=1e-6)


def test_patch_layout_matches_the_processors_patchify(fp32_engine):
    ip = fp32_engine.processor.image_processor
    rng = np.random.default_rng(0)
    video = still_video(np.zeros((64, 96, 3), np.uint8), 6)
    video = DecodedVideo(**{**video.__dict__, "frames": rng.integers(0, 256, (6, 64, 96, 3), dtype=np.uint8)})
    x = (torch.from_numpy(video.frames).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
    expected, t, h, w = Qwen3VLVideoProcessor.patchify(None, x[None], patch_size=16, merge_size=2, temporal_patch_size=2)
    patches, grid = video_patches(video, ip)
    assert grid.tolist() == [[t, h, w]] == [[3, 4, 6]]
    torch.testing.assert_close(patches, expected[0], rtol=0, atol=1e-6)


def test_prompt_text_matches_the_processors_replace_video_token(fp32_engine, tmp_path):
    processor = fp32_engine.processor
    video = decode_video(write_clip(tmp_path / "clip.mp4", frames=50, fps=10.0), LIMITS)
    _, grid = video_patches(video, processor.image_processor)
    reference = SimpleNamespace(
        video_processor=Qwen3VLVideoProcessor(), vision_start_token=processor.vision_start_token,
        video_token=processor.video_token, vision_end_token=processor.vision_end_token,
        _calculate_timestamps=lambda *args: Qwen3VLProcessor._calculate_timestamps(None, *args))
    inputs = {"video_grid_thw": grid, "video_metadata": [
        VideoMetadata(total_num_frames=video.source_frames, fps=video.source_fps,
                      frames_indices=list(video.frame_indices))]}
    expected = Qwen3VLProcessor.replace_video_token(reference, inputs, video_idx=0)
    assert video_prompt_text(processor, grid[0], video.timestamps()) == expected
    assert expected.startswith("<0.2 seconds><|vision_start|>") and expected.count("seconds>") == 5


def test_video_features_one_frame_pair_at_a_time_equal_get_video_features(fp32_engine, tmp_path):
    model = fp32_engine.model
    video = decode_video(write_clip(tmp_path / "clip.webm", frames=30, fps=10.0), LIMITS)
    pixel_values, grid = video_patches(video, fp32_engine.processor.image_processor)
    with torch.inference_mode():
        whole = model.model.get_video_features(pixel_values, grid)
        ours = encode_video(TorchVisionEncoder(model), pixel_values, grid)
    torch.testing.assert_close(ours.pooler, whole.pooler_output[0], rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(ours.deepstack, whole.deepstack_features, strict=True):
        torch.testing.assert_close(mine, theirs[0], rtol=1e-5, atol=1e-5)


# -- bad files --------------------------------------------------------------------------------------

def _bad_files(tmp_path) -> dict[str, tuple[bytes, VideoLimits, type, str]]:
    mp4 = write_clip(tmp_path / "ok.mp4", frames=20)
    avi = write_clip(tmp_path / "ok.avi", frames=40)
    webm = write_clip(tmp_path / "ok.webm", frames=40)
    holed = bytearray(mp4)
    holed[len(mp4) // 3:len(mp4) // 2] = bytes(len(mp4) // 2 - len(mp4) // 3)
    long = write_clip(tmp_path / "long.avi", frames=100, fps=2.0, size=(64, 48))
    wide = write_clip(tmp_path / "wide.webm", frames=4, size=(640, 480))
    return {
        "empty": (b"", LIMITS, VideoError, "empty"),
        "text": (b"hello, this is not a video at all" * 10, LIMITS, VideoError, "not a supported video"),
        "png": (encode(pattern(64, 64), ".png"), LIMITS, VideoError, "not a supported video"),
        "hls playlist": (b"#EXTM3U\n#EXTINF:10,\nfile:///etc/passwd\n", LIMITS, VideoError, "not a supported video"),
        "truncated mp4": (mp4[: len(mp4) // 2], LIMITS, VideoError, "MP4"),
        "mp4 header only": (mp4[:32], LIMITS, VideoError, "MP4"),
        "garbage after magic": (mp4[:12] + bytes(range(256)) * 40, LIMITS, VideoError, "MP4"),
        "truncated avi": (avi[: len(avi) * 6 // 10], LIMITS, VideoError, "truncated or corrupt"),
        "truncated webm": (webm[: len(webm) * 6 // 10], LIMITS, VideoError, "truncated or corrupt"),
        "zeroed middle": (bytes(holed), LIMITS, VideoError, "truncated or corrupt"),
        "too many bytes": (mp4, VideoLimits(**{**LIMITS.__dict__, "max_bytes": len(mp4) - 1}), TooLarge, "bytes"),
        "too long": (long, LIMITS, TooLarge, "50.0 s long"),
        "frames too big": (wide, VideoLimits(**{**LIMITS.__dict__, "max_source_pixels": 320 * 240}), TooLarge,
                           "640x480"),
    }


def test_bad_files_are_refused_with_a_reason_and_leave_no_temporary_file(tmp_path, own_tempdir):
    for name, (data, limits, error, reason) in _bad_files(tmp_path).items():
        with pytest.raises(error) as caught:
            decode_video(data, limits)
        assert caught.value.status == (413 if error is TooLarge else 400), name
        assert reason in caught.value.message, (name, caught.value.message)
        assert leftovers(own_tempdir) == [], name
