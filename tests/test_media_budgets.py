"""Per-request picture and clip budgets on the shared Gunicorn: a floor beside the ceiling
(`min_pixels`, OpenAI's detail "high", the grounding preset's 1,024 visual tokens), a clip's own
sampling (`fps`, `max_frames`; vLLM's `media_io_kwargs`), out-of-range values refused by name, and
the visual tokens each picture and clip got on the native done line."""

from __future__ import annotations

import base64
import json

import pytest
import requests

from clips import noise, write_clip
from imaging import data_url, encode, pattern

SMALL = encode(pattern(64, 64), ".png")  # scaled up to the processor's floor, 256² (a token: 32 × 32 pixels)


@pytest.fixture
def server(shared_server):
    return shared_server


def native(server, **body) -> dict:
    reply = requests.post(f"{server}/v1/chat", json={"max_tokens": 2, "stream": False, **body}, timeout=120)
    return reply.json() | {"status": reply.status_code}


def picture(**body) -> dict:
    return {"prompt": "What is it?", "images": [base64.b64encode(SMALL).decode()], **body}


def test_a_floor_scales_a_small_picture_up_and_the_done_line_says_by_how_much(server):
    assert native(server, **picture())["image_tokens"] == [64]
    assert native(server, **picture(min_pixels=512 * 512))["image_tokens"] == [256]
    grounded = native(server, **picture(response_format={"type": "grounding"}))
    assert grounded["image_tokens"] == [1024]  # the grounding preset's floor (IMAGE_REQUEST_MAX_PIXELS 1024²)


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"min_pixels": 2048 * 2048}, "min_pixels"),
        ({"min_pixels": 512 * 512, "max_pixels": 256 * 256}, "min_pixels"),
        ({"max_frames": 10_000}, "max_frames"),
        ({"fps": 0}, "fps"),
    ],  # fmt: skip
)
def test_out_of_range_budgets_are_a_400_naming_the_field(server, fields, named):
    reply = native(server, **picture(**fields))
    assert reply["status"] == 400 and named in reply["error"]["param"]


def test_detail_high_raises_the_floor_on_the_openai_endpoint(server):
    def prompt_tokens(detail: str) -> int:
        content = [{"type": "image_url", "image_url": {"url": data_url(SMALL), "detail": detail}}]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        return requests.post(f"{server}/v1/chat/completions", json=body, timeout=120).json()["usage"]["prompt_tokens"]

    assert prompt_tokens("high") - prompt_tokens("auto") == 1024 - 64


def test_a_clip_samples_as_the_request_asks(server, tmp_path):
    # 4 s, a clip of its own: the shared server's vision cache must not serve another module's frames
    clip = base64.b64encode(write_clip(tmp_path / "c.mp4", frames=40, fps=10.0, size=(128, 96), frame=noise)).decode()
    default = native(server, prompt="What happens?", videos=[clip])["video_tokens"]
    fewer = native(server, prompt="What happens?", videos=[clip], max_frames=4)["video_tokens"]
    slower = native(server, prompt="What happens?", videos=[clip], fps=1)["video_tokens"]
    assert fewer[0] * 2 == default[0] and slower == fewer  # 8 frames at 2 fps; 4 at most, or 1 a second
    content = [{"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{clip}"}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
    usage = [
        requests.post(f"{server}/v1/chat/completions", json={**body, **extra}, timeout=120).json()["usage"]
        for extra in ({}, {"media_io_kwargs": {"video": {"num_frames": 4}}})
    ]
    assert usage[0]["prompt_tokens"] - usage[1]["prompt_tokens"] >= default[0] - fewer[0]
    assert json.dumps(usage)  # both answered
