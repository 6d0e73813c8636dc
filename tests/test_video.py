"""Video input: clips written with OpenCV, decoded, sampled and laid out as Qwen3-VL's processor would,
answered by the embedded tiny model through the engine and both HTTP endpoints."""

from __future__ import annotations

import base64
import json
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest
import requests
import torch
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
from transformers.video_utils import VideoMetadata

from service.engine.engine import Completion, Engine, GenerationRequest, SamplingParams, TextDelta
from service.errors import BadRequest, TooLarge, VideoError
from service.media.images import decode_image
from service.media.video import (
    TEMP_PREFIX,
    DecodedVideo,
    VideoLimits,
    decode_video,
    frame_size,
    frame_timestamps,
    sample_indices,
    video_patches,
    video_prompt_text,
)
from service.model.prompts import ChatMessage, ImagePart, TextPart, VideoPart
from service.vision.features import TorchVisionEncoder
from service.vision.steps import run_to_end, video_steps

from clips import WRITABLE, noise, write_clip
from conftest import generate_config, prepared, transformers_model, weights_settings
from imaging import data_url, encode, pattern
from servers import openai_client

LIMITS = VideoLimits(
    max_bytes=5 * 1024 * 1024,
    max_seconds=30,
    max_source_pixels=1920 * 1080,
    max_source_frames=900,
    fps=2.0,
    max_frames=32,
    max_visual_tokens=1024,
    max_frame_pixels=448 * 448,
)


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
    return DecodedVideo(
        frames=np.stack([image] * frames),
        frame_indices=tuple(range(frames)),
        source_fps=1.0,
        source_format="test",
        source_size=(image.shape[1], image.shape[0]),
        source_frames=frames,
        decode_seconds=0.0,
        digest="still",
    )


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
    patches, grid = video_patches(
        video,
        SimpleNamespace(
            patch_size=16,
            merge_size=2,
            temporal_patch_size=2,
            rescale_factor=1 / 255,
            image_mean=[0.5] * 3,
            image_std=[0.5] * 3,
        ),
    )
    t, h, w = grid[0].tolist()
    assert t == 3 and t * h * w // 4 <= 60  # 3 frame pairs within 60 tokens
    assert video.size == (160, 96)  # the processor's rule rounds down into 20 tokens a pair: 15
    assert patches.shape == (t * h * w, 3 * 2 * 16 * 16)
    odd = decode_video(data, VideoLimits(**{**LIMITS.__dict__, "fps": 0.5}))
    assert odd.frame_indices == (0, 25, 50, 74, 99, 99)  # 5 frames: the last repeated to make pairs


def test_sampling_matches_the_processors_sample_frames():
    processor = Qwen3VLVideoProcessor()
    for total, fps, rate, cap in [
        (40, 10.0, 2.0, 32),
        (300, 30.0, 2.0, 32),
        (3000, 25.0, 2.0, 32),
        (7, 24.0, 2.0, 32),
        (2, 30.0, 2.0, 32),
        (120, 29.97, 1.0, 8),
        (1, 5.0, 2.0, 32),
    ]:
        processor.max_frames = cap
        limits = VideoLimits(**{**LIMITS.__dict__, "fps": rate, "max_frames": cap})
        expected = processor.sample_frames(VideoMetadata(total_num_frames=total, fps=fps), fps=rate).tolist()
        assert sample_indices(total, fps, limits) == expected, (total, fps, rate, cap)


def test_timestamps_match_the_processors():
    for indices, fps in [([0, 6, 11, 17], 10.0), ([0, 25, 50, 74, 99], 29.97), ([0], 24.0), ([3, 9, 15], 7.5)]:
        assert frame_timestamps(indices, fps, 2) == Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)


def test_frame_size_is_the_processors_resize_rule_with_a_per_frame_budget():
    for width, height, frames in [
        (1920, 1080, 20),
        (160, 120, 8),
        (640, 480, 32),
        (1080, 1920, 4),
        (300, 37, 2),
        (4000, 100, 10),
        (40, 24, 8),  # a side below 32: scaled up to it first
        (20, 300, 4),
    ]:
        groups = frames // 2
        per_frame = min(LIMITS.max_visual_tokens // groups * 32 * 32, LIMITS.max_frame_pixels)
        h, w = smart_resize(
            frames,
            height,
            width,
            temporal_factor=2,
            factor=32,
            min_pixels=frames * 32 * 32,
            max_pixels=frames * per_frame,
        )
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
    expected, t, h, w = Qwen3VLVideoProcessor.patchify(
        None, x[None], patch_size=16, merge_size=2, temporal_patch_size=2
    )
    patches, grid = video_patches(video, ip)
    assert grid.tolist() == [[t, h, w]] == [[3, 4, 6]]
    torch.testing.assert_close(patches, expected[0], rtol=0, atol=1e-6)


def test_prompt_text_matches_the_processors_replace_video_token(fp32_engine, tmp_path):
    processor = fp32_engine.processor
    video = decode_video(write_clip(tmp_path / "clip.mp4", frames=50, fps=10.0), LIMITS)
    _, grid = video_patches(video, processor.image_processor)
    reference = SimpleNamespace(
        video_processor=Qwen3VLVideoProcessor(),
        vision_start_token=processor.vision_start_token,
        video_token=processor.video_token,
        vision_end_token=processor.vision_end_token,
        _calculate_timestamps=lambda *args: Qwen3VLProcessor._calculate_timestamps(None, *args),
    )
    inputs = {
        "video_grid_thw": grid,
        "video_metadata": [
            VideoMetadata(
                total_num_frames=video.source_frames, fps=video.source_fps, frames_indices=list(video.frame_indices)
            )
        ],
    }
    expected = Qwen3VLProcessor.replace_video_token(reference, inputs, video_idx=0)
    assert video_prompt_text(processor, grid[0], video.timestamps()) == expected
    assert expected.startswith("<0.2 seconds><|vision_start|>") and expected.count("seconds>") == 5


def test_video_features_one_frame_pair_at_a_time_equal_get_video_features(fp32_engine, tmp_path, tiny_dir):
    """Within float rounding of the largest value (the tower's float operations round otherwise than torch's:
    service/native/float_ops.py, the same bits on every CPU)."""
    model = fp32_engine.model
    video = decode_video(write_clip(tmp_path / "clip.webm", frames=30, fps=10.0), LIMITS)
    pixel_values, grid = video_patches(video, fp32_engine.processor.image_processor)
    with torch.inference_mode():
        whole = transformers_model(tiny_dir).model.get_video_features(pixel_values, grid)  # transformers' own
        ours = run_to_end(video_steps(TorchVisionEncoder(model), pixel_values, grid))  # what the engine runs
    pairs = [(ours.pooler, whole.pooler_output[0])]
    pairs += [(mine, theirs[0]) for mine, theirs in zip(ours.deepstack, whole.deepstack_features, strict=True)]
    for mine, theirs in pairs:
        assert float((mine - theirs).abs().max() / theirs.abs().max()) < 1e-5


# -- bad files --------------------------------------------------------------------------------------


def _bad_files(tmp_path) -> dict[str, tuple[bytes, VideoLimits, type, str]]:
    mp4 = write_clip(tmp_path / "ok.mp4", frames=20)
    avi = write_clip(tmp_path / "ok.avi", frames=40)
    webm = write_clip(tmp_path / "ok.webm", frames=40)
    holed = bytearray(mp4)
    holed[len(mp4) // 3 : len(mp4) // 2] = bytes(len(mp4) // 2 - len(mp4) // 3)
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
        "too many frames": (
            long,
            VideoLimits(**{**LIMITS.__dict__, "max_seconds": 60, "max_source_frames": 99}),
            TooLarge,
            "100 frames",
        ),
        "frames too big": (
            wide,
            VideoLimits(**{**LIMITS.__dict__, "max_source_pixels": 320 * 240}),
            TooLarge,
            "640x480",
        ),
    }


def test_bad_files_are_refused_with_a_reason_and_leave_no_temporary_file(tmp_path, own_tempdir):
    for name, (data, limits, error, reason) in _bad_files(tmp_path).items():
        with pytest.raises(error) as caught:
            decode_video(data, limits)
        assert caught.value.status == (413 if error is TooLarge else 400), name
        assert reason in caught.value.message, (name, caught.value.message)
        assert leftovers(own_tempdir) == [], name


# -- through the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> bytes:
    """4 s at 10 fps, 160×120: 8 frames sampled, 4 pairs of 5×4 tokens = 80 visual tokens."""
    return write_clip(tmp_path_factory.mktemp("clips") / "square.mp4", frames=40, fps=10.0)


def user(*parts) -> ChatMessage:
    return ChatMessage(
        "user",
        [
            TextPart(p) if isinstance(p, str) else VideoPart(p) if isinstance(p, DecodedVideo) else ImagePart(p)
            for p in parts
        ],
    )


def answer(engine, messages, conversation_id=None, max_tokens=8) -> tuple[list, Completion]:
    """Events of one generation, sampled with a fixed seed (it follows logit changes greedy hides)."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=0, top_p=1.0, seed=3)
    request = GenerationRequest(messages, sampling, conversation_id=conversation_id)
    events = list(engine.generate(request))
    return events, events[-1]


@pytest.fixture
def engines(engine, cache_dir):
    """(caches on, caches off) over the same loaded model, fp32, INT8 and 4-bit."""
    q = engine.loaded.quantization
    return (
        Engine(engine.loaded, weights_settings(cache_dir, q)),
        Engine(engine.loaded, weights_settings(cache_dir, q, cache_enabled=False)),
    )


def test_a_question_about_a_clip_streams_an_answer(engine, clip):
    video = decode_video(clip, engine.limits.video)
    events, done = answer(engine, [user(video, "What happens in this clip?")], max_tokens=12)
    assert sum(isinstance(e, TextDelta) for e in events) >= 2 and isinstance(done, Completion)
    assert done.completion_tokens == 12 and done.videos == 1 and done.images == 0
    text_only = prepared(engine, GenerationRequest([user("What happens in this clip?")])).num_tokens
    # 80 visual tokens, each of the 4 frame pairs with a "<t seconds>" and its start and end tokens.
    assert done.prompt_tokens - text_only > 80 + 4 * 2
    assert done.timings.vision_encode > 0


def test_follow_up_question_reuses_the_cache_and_answers_as_a_full_recompute(engines, clip):
    cached, plain = engines
    video = decode_video(clip, cached.limits.video)
    history = [user(video, "What happens in this clip?")]
    first, done = answer(cached, history, "clip-1")
    assert [e.text for e in first[:-1]] == [e.text for e in answer(plain, history)[0][:-1]]
    history += [ChatMessage("assistant", [TextPart(done.text)]), user("And then?")]
    second, again = answer(cached, history, "clip-1")
    video_end = prepared(cached, GenerationRequest(history)).video_spans[0][1]
    assert again.cached_tokens >= video_end  # the whole video came from the KV cache
    assert again.timings.vision_encode < done.timings.vision_encode
    assert again.text == answer(plain, history)[1].text


def test_another_clip_behind_the_same_tokens_is_not_taken_from_the_cache(engines, clip, tmp_path):
    cached, plain = engines
    square = decode_video(clip, cached.limits.video)
    other = decode_video(write_clip(tmp_path / "noise.mp4", frames=40, fps=10.0, frame=noise), cached.limits.video)
    question = [user(square, "What happens?")]
    answer(cached, question, "square")
    swapped = [user(other, "What happens?")]
    prompt = prepared(cached, GenerationRequest(swapped))
    assert prompt.input_ids.tolist() == prepared(cached, GenerationRequest(question)).input_ids.tolist()
    _, done = answer(cached, swapped, "noise")
    assert done.cached_tokens <= prompt.video_spans[0][0] and done.vision_cache_hits == 0
    assert done.text == answer(plain, swapped)[1].text


def test_same_clip_in_a_new_conversation_skips_the_vision_encoder(engines, clip):
    cached, _ = engines
    video = decode_video(clip, cached.limits.video)
    answer(cached, [user(video, "What moves?")])
    _, done = answer(cached, [user("Another question.", video)])
    assert done.vision_cache_hits == 1


def test_images_and_a_video_in_one_conversation_answer_as_the_models_own_pixel_path(fp32_engine, tmp_path, tiny_dir):
    """What this service feeds the model for a video equals what the model computes from the pixels.
    (Sampled with a seed: sampling follows small logit changes that greedy decoding can hide.)"""
    engine = fp32_engine
    picture = decode_image(encode(pattern(256, 256), ".png"), engine.limits.image)
    video = decode_video(write_clip(tmp_path / "noise.avi", frame=noise), engine.limits.video)
    messages = [user(picture, "Look at this picture, then this clip:", video, "What changed?")]
    sampling = SamplingParams(max_tokens=30, temperature=1.0, top_k=0, top_p=1.0, seed=7)
    done = list(engine.generate(GenerationRequest(messages, sampling)))[-1]
    prompt = prepared(engine, GenerationRequest(messages))
    assert prompt.image_spans[0][1] <= prompt.video_spans[0][0]
    torch.manual_seed(7)
    with torch.inference_mode():
        out = transformers_model(tiny_dir).generate(  # transformers' own model from the pixels
            input_ids=prompt.input_ids,
            attention_mask=torch.ones_like(prompt.input_ids),
            mm_token_type_ids=prompt.mm_token_type_ids,
            image_grid_thw=prompt.image_grid_thw,
            pixel_values=torch.cat(prompt.pixel_values),
            video_grid_thw=prompt.video_grid_thw,
            pixel_values_videos=torch.cat(prompt.pixel_values_videos),
            generation_config=generate_config(engine, sampling, 30),
        )
    model_text = engine.processor.tokenizer.decode(out[0, prompt.num_tokens :], skip_special_tokens=True)
    assert done.text == model_text and done.images == 1 and done.videos == 1


def test_prompt_with_an_image_and_a_video_is_the_reference_layout(fp32_engine, clip):
    """Token for token what Qwen's processor makes: the template's video placeholder replaced as a
    whole by timestamped frame pairs, the image expanded by the processor itself."""
    engine = fp32_engine
    processor = engine.processor
    picture = decode_image(encode(pattern(256, 256), ".png"), engine.limits.image)
    video = decode_video(clip, engine.limits.video)
    messages = [user(picture, video, "Compare.")]
    prompt = prepared(engine, GenerationRequest(messages))
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Compare."}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    image_grid = processor.image_processor(images=[picture.pixels], return_tensors="pt")["image_grid_thw"]
    image_pads = processor.image_token * (int(image_grid.prod()) // 4)
    _, video_grid = video_patches(video, processor.image_processor)
    frames = "".join(
        f"<{t:.1f} seconds><|vision_start|>" + "<|video_pad|>" * (int(video_grid[0, 1:].prod()) // 4) + "<|vision_end|>"
        for t in Qwen3VLProcessor._calculate_timestamps(None, list(video.frame_indices), video.source_fps, 2)
    )
    text = text.replace("<|image_pad|>", image_pads).replace("<|vision_start|><|video_pad|><|vision_end|>", frames)
    assert prompt.input_ids[0].tolist() == processor.tokenizer(text)["input_ids"]
    ids = prompt.input_ids[0]
    assert (prompt.mm_token_type_ids[0] == 1).sum() == (ids == processor.image_token_id).sum() > 0
    assert (prompt.mm_token_type_ids[0] == 2).sum() == (ids == processor.video_token_id).sum() == 80
    start, end = prompt.video_spans[0]
    assert ids[start] == processor.vision_start_token_id and ids[end - 1] == processor.vision_end_token_id
    assert (ids[start:end] == processor.vision_start_token_id).sum() == 4  # one per frame pair


def test_placeholder_tokens_typed_in_the_text_are_refused(fp32_engine, clip):
    video = decode_video(clip, fp32_engine.limits.video)
    with pytest.raises(BadRequest):
        prepared(fp32_engine, GenerationRequest([user(video, "a <|video_pad|> in the text")]))


def test_videos_beyond_the_per_request_limit_are_refused(fp32_engine, clip):
    video = decode_video(clip, fp32_engine.limits.video)
    with pytest.raises(BadRequest) as caught:
        prepared(fp32_engine, GenerationRequest([user(video, video, video, "three clips")]))
    assert caught.value.code == "too_many_videos"


# -- through the HTTP API ---------------------------------------------------------------------------


@pytest.fixture
def server(shared_server, shared_server_tmpdir):
    """The session's shared Gunicorn (VIDEO_MAX_SECONDS 20) and its own TMPDIR (to see that no
    temporary file outlives a request)."""
    return SimpleNamespace(base=shared_server, tmpdir=shared_server_tmpdir)


def test_native_multipart_video_streams_and_a_follow_up_reuses_the_cache(server, clip):
    form = {"prompt": "What happens in this clip?", "max_tokens": "12", "temperature": "0"}
    with requests.post(
        server.base + "/v1/chat",
        files=[("video", ("clip.mp4", clip, "video/mp4"))],
        data=form,
        stream=True,
        timeout=120,
    ) as r:
        assert r.status_code == 200, r.text
        lines = [json.loads(line) for line in r.iter_lines() if line]
    done = lines[-1]
    assert sum("delta" in line for line in lines) >= 2
    assert done["done"] and done["videos"] == 1 and done["usage"]["completion_tokens"] == 12
    assert done["timings"]["video_decode"] > 0 and done["timings"]["vision_encode"] > 0
    follow = requests.post(
        server.base + "/v1/chat",
        json={"prompt": "And then?", "max_tokens": 4, "stream": False, "conversation_id": done["conversation_id"]},
        timeout=120,
    )
    assert follow.status_code == 200, follow.text
    # The remembered clip is not decoded again and its tokens come from the KV cache.
    assert follow.json()["usage"]["cached_tokens"] > 80
    assert follow.json()["timings"]["video_decode"] == 0


def test_native_json_with_an_image_and_a_base64_video(server, clip):
    png = encode(pattern(256, 256), ".png")
    r = requests.post(
        server.base + "/v1/chat",
        json={
            "prompt": "Compare the picture with the clip.",
            "images": [data_url(png, "image/png")],
            "videos": [base64.b64encode(clip).decode()],
            "max_tokens": 4,
            "stream": False,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["images"] == 1 and r.json()["videos"] == 1


def test_openai_client_takes_a_video_url_part_beside_an_image(server, clip):
    client = openai_client(server.base)
    png = encode(pattern(256, 256), ".png")
    content = [
        {"type": "image_url", "image_url": {"url": data_url(png, "image/png")}},
        {"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}},
        {"type": "text", "text": "What moves?"},
    ]
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": content}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    text_only = client.chat.completions.create(
        model="m", max_tokens=1, messages=[{"role": "user", "content": "What moves?"}]
    ).usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens > text_only + 64 + 80  # the picture's 64 tokens and the clip's 80


def test_bad_video_uploads_get_4xx_and_leave_no_temporary_file(server, clip, tmp_path):
    long = write_clip(tmp_path / "long.avi", frames=250, fps=10.0, size=(64, 48))
    cases = [
        (
            dict(files=[("video", ("cut.mp4", clip[: len(clip) // 2], "video/mp4"))], data={"prompt": "?"}),
            400,
            "invalid_video",
            "video[0]",
        ),
        (
            dict(files=[("video", ("long.avi", long, "video/x-msvideo"))], data={"prompt": "?"}),
            413,
            "video_too_long",
            "video[0]",
        ),
        (dict(json={"prompt": "?", "videos": ["not base64!"]}), 400, "invalid_video", "videos[0]"),
        (
            dict(
                json={
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "video_url", "video_url": {"url": data_url(clip, "image/png")}}],
                        }
                    ]
                }
            ),
            400,
            "invalid_video",
            "messages[0].content[0]",
        ),
        (
            dict(
                json={
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "video_url", "video_url": "https://example.com/clip.mp4"}],
                        }
                    ]
                }
            ),
            400,
            "remote_video_refused",
            "messages[0].content[0]",
        ),
    ]
    for kwargs, status, code, param in cases:
        r = requests.post(server.base + "/v1/chat", timeout=60, **kwargs)
        assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (status, code, param), r.text
    assert [p.name for p in server.tmpdir.iterdir() if p.name.startswith(TEMP_PREFIX)] == []
    assert (
        requests.post(
            server.base + "/v1/chat",
            files=[("video", ("clip.mp4", clip, "video/mp4"))],
            timeout=120,
            data={"prompt": "Still serving?", "max_tokens": "2", "stream": "false"},
        ).status_code
        == 200
    )
