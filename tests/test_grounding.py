"""Grounding (service/answer/grounding.py): the boxes and points an answer names, in the pixels of the
picture the client sent — parsed from every shape an answer writes them in, mapped through EXIF
orientation and the service's own resize, clipped and flagged outside 0-1000, never an error — and the
`grounding` response format, the per-request picture budget, both endpoints and the CLI.
"""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest
import requests

from service.answer.grounding import GROUNDING_SCHEMA, find_boxes
from service.answer.structured import json_grammar
from service.engine.engine import Completion, GenerationRequest, SamplingParams
from service.media.images import decode_image
from service.model.prompts import ChatMessage, ImagePart, TextPart, pictures_of

from conftest import run_cli
from imaging import data_url, encode, pattern, with_exif_orientation
from servers import openai_client

PICTURE = (640, 360)  # width, height: not square

SHAPES = {
    "a list": '[{"bbox_2d": [100, 200, 500, 800], "label": "cat"}, {"bbox_2d": [0, 0, 1000, 1000], "label": "all"}]',
    "one object": '{"bbox_2d": [100, 200, 500, 800], "label": "cat"} {"bbox_2d": [0, 0, 1000, 1000], "label": "all"}',
    "fenced, prose around": 'Here they are:\n```json\n[{"bbox_2d": [100, 200, 500, 800], "label": "cat"},\n'
    ' {"bbox_2d": [0, 0, 1000, 1000], "label": "all"}]\n```\nDone.',
    "nested list": '[[{"bbox_2d": [100, 200, 500, 800], "label": "cat"}],'
    ' [{"bbox_2d": [0, 0, 1000, 1000], "label": "all"}]]',
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_boxes_in_every_shape_an_answer_writes_them(shape):
    boxes = find_boxes(SHAPES[shape], [PICTURE])
    assert [b.label for b in boxes] == ["cat", "all"]
    assert boxes[0].relative == (100, 200, 500, 800)
    assert boxes[0].pixels == (64, 72, 320, 288)  # x scales with the width, y with the height
    assert boxes[1].pixels == (0, 0, 640, 360) and not any(b.clipped for b in boxes)


def test_points_and_corners_given_backwards():
    [point, box] = find_boxes(
        '[{"point_2d": [250, 500], "label": "eye"}, {"bbox_2d": [500, 800, 100, 200]}]', [PICTURE]
    )
    assert (point.kind, point.pixels, point.label) == ("point", (160, 180), "eye")
    assert (box.kind, box.pixels, box.label) == ("bbox", (64, 72, 320, 288), None)


def test_coordinates_outside_0_to_1000_are_clipped_and_flagged():
    [box] = find_boxes('{"bbox_2d": [-20, 100, 1200, 1000.5], "label": "wide"}', [PICTURE])
    assert box.clipped and box.relative == (0, 100, 1000, 1000)
    assert box.written == (-20, 100, 1200, 1000.5) and box.pixels == (0, 36, 640, 360)


@pytest.mark.parametrize(
    "answer",
    [
        '[{"bbox_2d": [1, 2, 3', "no JSON at all", '{"bbox_2d": "a box"}', '{"bbox_2d": [1, 2, 3]}',
        '[{"bbox_2d": [true, 1, 2, 3]}]', "null", '{"point_2d": [1, 2, 3]}', "[[[[[[[[]]]]]]]]", "{" * 5000,
    ],
)  # fmt: skip
def test_malformed_boxes_give_no_boxes_never_an_error(answer):
    assert find_boxes(answer, [PICTURE]) == []


def test_several_pictures_each_object_names_its_own():
    answer = '[{"bbox_2d": [0, 0, 500, 500], "label": "a"}, {"bbox_2d": [0, 0, 500, 500], "label": "b", "image": 2}]'
    a, b = find_boxes(answer, [(100, 100), (2000, 1000)])
    assert (a.image, a.pixels) == (0, (0, 0, 50, 50))
    assert (b.image, b.pixels) == (1, (0, 0, 1000, 500))
    assert find_boxes(answer, []) == []  # no picture: nothing to map onto


def limits(engine):
    return engine.limits.image


def test_a_picture_larger_than_the_budget_maps_onto_its_own_pixels(fp32_engine):
    image = decode_image(encode(pattern(1600, 900), ".png"), limits(fp32_engine))
    assert image.size[0] * image.size[1] <= limits(fp32_engine).max_pixels < 1600 * 900  # the service resized it
    [box] = find_boxes('{"bbox_2d": [100, 100, 900, 900]}', [image.sent_size])
    assert image.sent_size == (1600, 900) and box.pixels == (160, 90, 1440, 810)


@pytest.mark.parametrize("size", [(320, 192), (3000, 2000)])
@pytest.mark.parametrize("orientation, turned", [(1, False), (3, False), (6, True), (8, True)])
def test_an_exif_rotated_jpeg_maps_onto_the_picture_as_shown(fp32_engine, size, orientation, turned):
    jpeg = with_exif_orientation(encode(pattern(*size), ".jpg"), orientation)
    image = decode_image(jpeg, limits(fp32_engine))
    shown = size[::-1] if turned else size
    assert image.sent_size == shown
    [box] = find_boxes('{"bbox_2d": [0, 0, 500, 1000]}', [image.sent_size])
    assert box.pixels == (0, 0, shown[0] / 2, shown[1])


def test_boxes_refer_to_the_latest_user_message_with_pictures(fp32_engine):
    one, two = (decode_image(encode(pattern(w, h), ".png"), limits(fp32_engine)) for w, h in ((300, 200), (200, 300)))
    messages = [
        ChatMessage("user", [ImagePart(one), TextPart("a")]),
        ChatMessage("assistant", [TextPart("b")]),
        ChatMessage("user", [ImagePart(one), ImagePart(two), TextPart("c")]),
        ChatMessage("assistant", [TextPart("d")]),
        ChatMessage("user", [TextPart("Where is it?")]),
    ]
    assert pictures_of(messages) == [(300, 200), (200, 300)]


# -- the grounding answer format, the engine, the endpoints -----------------------------------------


def locate(engine, image, max_tokens=160):
    request = GenerationRequest(
        [ChatMessage("user", [ImagePart(image), TextPart("Locate every object.")])],
        SamplingParams(max_tokens=max_tokens, temperature=0),
        grammar=json_grammar(GROUNDING_SCHEMA, "response_format"),
    )
    return [e for e in engine.generate(request) if isinstance(e, Completion)][0]


def test_the_grounding_format_makes_even_the_random_model_answer_boxes(fp32_engine):
    image = decode_image(encode(pattern(640, 360), ".png"), limits(fp32_engine))
    done = locate(fp32_engine, image)
    assert done.finish_reason == "stop", done.text  # the list closed within max_tokens
    parsed = json.loads(done.text)
    assert isinstance(parsed, list) and parsed and all("bbox_2d" in item for item in parsed)
    assert len(done.boxes) == len(parsed)
    for box, item in zip(done.boxes, parsed):
        (x1, x2), (y1, y2) = sorted(item["bbox_2d"][::2]), sorted(item["bbox_2d"][1::2])  # corners in order
        assert box.pixels == (round(x1 * 0.64, 1), round(y1 * 0.36, 1), round(x2 * 0.64, 1), round(y2 * 0.36, 1))


@pytest.fixture
def server(shared_server):
    return shared_server


def picture_message(png: bytes, text="Locate every object.", detail=None) -> list[dict]:
    image_url = {"url": data_url(png)} | ({"detail": detail} if detail else {})
    return [
        {"role": "user", "content": [{"type": "image_url", "image_url": image_url}, {"type": "text", "text": text}]}
    ]


JPEG_TURNED = with_exif_orientation(encode(pattern(640, 360), ".jpg"), 6)  # shown 360 wide, 640 high


def test_native_done_line_carries_boxes_in_the_clients_pixels(server):
    body = {
        "messages": picture_message(JPEG_TURNED),
        "response_format": {"type": "grounding"},
        "max_tokens": 160,
        "temperature": 0,
    }
    lines = [json.loads(x) for x in requests.post(server + "/v1/chat", json=body, timeout=60).iter_lines() if x]
    done = lines[-1]
    assert done["done"] and done["boxes"], done
    for box, item in zip(done["boxes"], json.loads(done["text"])):
        assert box["bbox_2d"] == item["bbox_2d"]  # as written
        (x1, x2), (y1, y2) = sorted(item["bbox_2d"][::2]), sorted(item["bbox_2d"][1::2])
        assert box["pixels"] == [round(x1 * 0.36, 1), round(y1 * 0.64, 1), round(x2 * 0.36, 1), round(y2 * 0.64, 1)]
        assert box["label"] == item["label"] and box["image"] == 0 and box["clipped"] is False
    plain = {**body, "response_format": None, "max_tokens": 4, "stream": False}
    assert requests.post(server + "/v1/chat", json=plain, timeout=60).json()["boxes"] == []  # free text: none


def test_openai_client_finds_the_boxes_in_model_extra(server):
    client = openai_client(server)
    reply = client.chat.completions.create(
        model="m",
        messages=picture_message(JPEG_TURNED),
        response_format={"type": "grounding"},
        max_tokens=160,
        temperature=0,
    )
    boxes = reply.choices[0].message.model_extra["boxes"]
    assert boxes and all(len(b["pixels"]) == 4 and b["pixels"][2] <= 360 for b in boxes)
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=picture_message(JPEG_TURNED),
            response_format={"type": "grounding"},
            max_tokens=160,
            temperature=0,
            stream=True,
        )
    )
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert last.choices[0].delta.model_extra["boxes"] == boxes  # the same answer, streamed


def test_a_request_chooses_its_picture_budget_within_the_servers(server):
    png = encode(pattern(1600, 900), ".png")

    def ask(intro: str, **extra) -> tuple[int, int]:
        """(prompt tokens, vision cache hits): text first, so no KV prefix holds the picture."""
        content = [{"type": "text", "text": intro}, {"type": "image_url", "image_url": {"url": data_url(png)}}]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1, "stream": False, **extra}
        r = requests.post(server + "/v1/chat", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"], r.json()["vision_cache_hits"]

    default, _ = ask("One.")
    small, _ = ask("Two.", max_pixels=128 * 128)
    again, hits = ask("Three.", max_pixels=128 * 128)
    large, large_hits = ask("Four.", max_pixels=1024 * 1024)
    assert small < default < large and again == small
    assert hits == 1 and large_hits == 0  # the vision cache keys on the picture as resized for the budget
    r = requests.post(
        server + "/v1/chat", json={"prompt": "x", "max_pixels": 4096 * 4096, "images": [data_url(png)]}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_pixels"
    assert "IMAGE_REQUEST_MAX_PIXELS" in r.json()["error"]["message"]
    client = openai_client(server)
    tokens = {}
    for detail in ("low", "auto", "high"):
        reply = client.chat.completions.create(model="m", messages=picture_message(png, detail=detail), max_tokens=1)
        tokens[detail] = reply.usage.prompt_tokens
    assert tokens["low"] < tokens["auto"] < tokens["high"]
    r = requests.post(
        server + "/v1/chat/completions",
        json={"model": "m", "messages": picture_message(png, detail="huge"), "max_tokens": 1},
        timeout=60,
    )
    assert r.status_code == 400 and "detail" in json.dumps(r.json())


@pytest.mark.slow
def test_cli_draws_the_boxes_over_the_picture(cache_dir, tmp_path):
    photo = tmp_path / "turned.jpg"
    photo.write_bytes(JPEG_TURNED)
    out = tmp_path / "boxes.png"
    result = run_cli(
        "chat", "--image", str(photo), "--boxes", str(out), "Locate every object.",
        "--max-tokens", "160", "--temperature", "0", "--cache-dir", str(cache_dir), timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    printed = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"label"')]
    assert printed and all(len(p["pixels"]) == 4 for p in printed)
    drawn, shown = cv2.imread(str(out)), cv2.imread(str(photo))
    assert drawn.shape == shown.shape == (640, 360, 3)  # the picture as shown (EXIF applied), full size
    x1, y1, x2, y2 = (round(c) for c in printed[0]["pixels"])
    changed = np.abs(drawn.astype(int) - shown.astype(int)).sum(axis=2) > 60
    edge = changed[max(y1 - 2, 0) : y1 + 3, max(x1, 0) : max(x2, x1 + 1)]
    assert edge.any(), "the first box's top edge is drawn where its pixels say"
