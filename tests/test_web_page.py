"""The try-it page at GET / in a real browser (Debian's headless Chromium driven by Playwright)
against a real Gunicorn serving the embedded model."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import cv2
import jsonschema
import numpy as np
import pytest
import requests
from playwright.sync_api import Page, expect

from conftest import KEY
from imaging import encode, pattern
from servers import ROOT, metric

pytestmark = [pytest.mark.server, pytest.mark.browser]

ARTIFACTS = ROOT / "artifacts"
README_SCREENSHOT = ROOT / "docs" / "screenshot.png"  # rewritten when UPDATE_SCREENSHOT=1
DEMO_PNG = (ROOT / "tests" / "data" / "demo.png").read_bytes()


@pytest.fixture
def server(shared_server):
    return shared_server


@pytest.fixture
def page(browser, server):
    """The page, loaded; fails the test on a script error or a request leaving the origin."""
    context = browser.new_context(viewport={"width": 1000, "height": 900})
    tab = context.new_page()
    script_errors, foreign = [], []
    tab.on("pageerror", lambda error: script_errors.append(error))
    tab.on("request", lambda r: None if r.url.startswith((server + "/", "data:", "blob:")) else foreign.append(r.url))
    tab.goto(server + "/")
    yield tab
    context.close()
    assert not script_errors, script_errors
    assert not foreign, f"the page fetched from elsewhere: {foreign}"


def pick(page: Page, name: str, data: bytes, mime: str = "image/png") -> None:
    """Choose a file in the page's picture picker."""
    page.get_by_label("Pictures", exact=True).set_input_files(files=[{"name": name, "mimeType": mime, "buffer": data}])


def show_options(page: Page, shown: bool = True) -> None:
    if page.locator("#options").evaluate("details => details.open") != shown:
        page.locator("summary", has_text="Options").click()


def set_options(page: Page, max_tokens: int | None = None, temperature: float | None = None) -> None:
    show_options(page)
    if max_tokens is not None:
        page.get_by_label("Max new tokens").fill(str(max_tokens))
    if temperature is not None:
        page.get_by_label("Temperature").fill(str(temperature))
    show_options(page, False)


def ask(page: Page, question: str) -> None:
    """Type a question and press Enter, as a user does."""
    box = page.get_by_label("Question")
    box.fill(question)
    box.press("Enter")


def finished_turn(page: Page, number: int, timeout: float = 60_000):
    """The `number`-th turn (1-based) once its answer is complete (usage line shown)."""
    turn = page.locator(".turn").nth(number - 1)
    expect(turn.locator(".usage")).to_be_visible(timeout=timeout)
    return turn


def usage_numbers(turn) -> dict[str, int]:
    text = turn.locator(".usage").inner_text()
    found = re.search(r"(\d+) tokens, finish: \w+ · prompt (\d+) tokens, (\d+) from cache", text)
    assert found, text
    completion, prompt, cached = map(int, found.groups())
    return {"completion": completion, "prompt": prompt, "cached": cached}


def record_answer_lengths(page: Page) -> None:
    """Keep, in the page, the length of the last answer at every change, and whether it was done."""
    page.evaluate("""() => {
        window.answerLengths = [];
        new MutationObserver(() => {
            const turn = document.querySelector('.turn:last-of-type');
            const answer = turn && turn.querySelector('.answer');
            if (answer) window.answerLengths.push([answer.textContent.length, !!turn.querySelector('.usage')]);
        }).observe(document.getElementById('transcript'), {subtree: true, childList: true, characterData: true});
    }""")


def stop_at_first_text(page: Page) -> None:
    """Press Stop the moment the next answer shows text: the embedded model writes its 1,400 tokens in
    about half a second, faster than a click that waits for the button to settle."""
    page.evaluate("""() => {
        const stop = document.getElementById('stop');
        const watcher = new MutationObserver(() => {
            const answer = document.querySelector('.turn:last-of-type .answer');
            if (answer && answer.textContent.trim() && !stop.disabled) {
                watcher.disconnect();
                stop.click();
            }
        });
        watcher.observe(document.getElementById('transcript'), {subtree: true, childList: true, characterData: true});
    }""")


def upload_bytes(request) -> int:
    """The body size of a sent request (Chromium does not hand multipart bodies with files to Playwright)."""
    return int(request.all_headers()["content-length"])


def save_screenshot(page: Page, name: str, for_readme: bool = False, readme_copy: Path = README_SCREENSHOT) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    if for_readme and os.environ.get("UPDATE_SCREENSHOT") == "1":
        readme_copy.parent.mkdir(exist_ok=True)
        shutil.copyfile(path, readme_copy)
    return path


# -- the page and its files ---------------------------------------------------------------------


def test_page_and_its_files_are_served_with_types_and_revalidation(server):
    page = requests.get(server + "/")
    assert page.status_code == 200 and page.headers["Content-Type"] == "text/html; charset=utf-8"
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]  # no CDN could load
    for name, content_type in [("app.js", "text/javascript; charset=utf-8"), ("style.css", "text/css; charset=utf-8")]:
        r = requests.get(f"{server}/static/{name}")
        assert r.status_code == 200 and r.headers["Content-Type"] == content_type
        assert r.headers["Cache-Control"] == "no-cache" and r.headers["X-Content-Type-Options"] == "nosniff"
        again = requests.get(f"{server}/static/{name}", headers={"If-None-Match": r.headers["ETag"]})
        assert again.status_code == 304 and not again.content
    for missing in ("/static/nothing.js", "/static/../api/app.py", "/static/index.txt"):
        r = requests.get(server + missing)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_the_random_model_is_announced_at_the_top(page):
    banner = page.locator("#random-banner")
    expect(banner).to_be_visible()
    expect(banner).to_contain_text("RANDOM-WEIGHT test model: its answers are noise")
    assert banner.bounding_box()["y"] < 100


# -- asking ---------------------------------------------------------------------------------------


def test_a_large_picture_is_scaled_down_in_the_browser_before_upload(page, server):
    budget = requests.get(server + "/v1/models").json()["data"][0]["image_max_pixels"]
    big = encode(pattern(1280, 960), ".png")
    pick(page, "big.png", big)
    size = page.locator(".preview .size")
    expect(size).to_contain_text("sent as")
    found = re.search(r"1280×960 · 1\.\d MB → sent as (\d+)×(\d+)", size.inner_text())
    assert found, size.inner_text()
    width, height = map(int, found.groups())
    assert width * height <= budget and abs(width / height - 4 / 3) < 0.01
    expect(page.get_by_alt_text("Preview of big.png")).to_be_visible()
    set_options(page, max_tokens=4)
    with page.expect_request("**/v1/chat") as sent:
        ask(page, "What is in this picture?")
    assert upload_bytes(sent.value) < len(big) / 4
    assert usage_numbers(finished_turn(page, 1))["prompt"] > width * height // 1024  # the image's tokens


def test_the_answer_streams_in_and_the_timings_are_shown(page):
    pick(page, "gradient.png", encode(pattern(480, 360, seed=1), ".png"))
    expect(page.locator(".preview .size")).to_contain_text("480×360")
    set_options(page, max_tokens=300, temperature=0)
    record_answer_lengths(page)
    ask(page, "Describe this picture in detail.")  # the random model answers it for all 300 tokens
    turn = finished_turn(page, 1)
    assert usage_numbers(turn)["completion"] >= 50  # a long answer (the random model may end it early)
    while_streaming = {length for length, done in page.evaluate("window.answerLengths") if length and not done}
    assert len(while_streaming) >= 2, "the answer did not appear in steps"
    timings = turn.get_by_label("Timings").inner_text()
    for shown in ("queue", "image decode", "vision encode", "prefill", "first token", "tok/s", "total"):
        assert shown in timings
    expect(turn.locator(".usage")).to_contain_text("1 picture in the prompt")


def test_the_json_option_gives_an_answer_valid_against_the_typed_schema(page):
    schema = {
        "type": "object",
        "properties": {"animal": {"enum": ["cat", "dog"]}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["animal", "count"],
        "additionalProperties": False,
    }
    show_options(page)
    expect(page.get_by_label("JSON Schema")).to_be_disabled()
    page.get_by_label("Answer in JSON").check()
    page.get_by_label("JSON Schema").fill("{not json")
    ask(page, "Which animal, how many?")
    expect(page.get_by_role("status")).to_contain_text("not valid JSON")
    page.get_by_label("JSON Schema").fill(json.dumps(schema))
    set_options(page, temperature=1)
    ask(page, "Which animal, how many?")
    turn = finished_turn(page, 1)
    jsonschema.validate(json.loads(turn.locator(".answer").inner_text()), schema)  # the random model's answer


BOX_COLOURS = ["#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#008080"]  # app.js's, in order


def edge_pixels_in(picture: np.ndarray, colour: str, box: list[float]) -> float:
    """The share of the box's top edge (a 3 px band at y1, from x1 to x2, in the shot's pixels) that
    shows `colour`."""
    rgb = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])
    x1, y1, x2, _ = (round(c) for c in box)
    band = picture[max(y1, 0) : y1 + 3, max(x1 + 3, 0) : max(x2 - 3, x1 + 4), ::-1].astype(int)  # BGR → RGB
    return float((np.abs(band - rgb).sum(axis=2) < 40).mean()) if band.size else 0.0


def test_boxes_are_drawn_over_the_picture_where_their_coordinates_say(page):
    set_options(page, max_tokens=160, temperature=0)
    show_options(page)
    page.get_by_label("Answer with boxes").check()
    show_options(page, False)
    pick(page, "wide.png", encode(pattern(640, 360, seed=4), ".png"))
    with page.expect_response("**/v1/chat") as response:
        ask(page, "Locate every object.")
    turn = finished_turn(page, 1)
    done = json.loads(response.value.text().strip().splitlines()[-1])
    assert done["boxes"], done["text"]
    expect(turn.locator(".box")).to_have_count(len(done["boxes"]))
    frame = turn.locator(".picture").first
    shot = cv2.imdecode(np.frombuffer(frame.screenshot(), np.uint8), cv2.IMREAD_COLOR)
    height, width = shot.shape[:2]
    assert abs(width / height - 640 / 360) < 0.02  # the whole picture, its aspect kept
    # The largest box, in the shot's pixels: 0-1000 coordinates scaled to the picture as shown.
    i, box = max(enumerate(done["boxes"]), key=lambda b: abs(b[1]["bbox_2d"][2] - b[1]["bbox_2d"][0]))
    (x1, x2), (y1, y2) = sorted(box["bbox_2d"][::2]), sorted(box["bbox_2d"][1::2])  # as written: any corner order
    where = [x1 * width / 1000, y1 * height / 1000, x2 * width / 1000, y2 * height / 1000]
    assert edge_pixels_in(shot, BOX_COLOURS[i % 6], where) > 0.5, "the box's top edge is drawn where it says"
    save_screenshot(page, "grounding.png", for_readme=True, readme_copy=ROOT / "docs" / "grounding.png")
    show_options(page)
    page.get_by_label("Show boxes on the pictures").uncheck()
    hidden = cv2.imdecode(np.frombuffer(frame.screenshot(), np.uint8), cv2.IMREAD_COLOR)
    assert edge_pixels_in(hidden, BOX_COLOURS[i % 6], where) < 0.2  # the toggle hides them


def test_a_follow_up_continues_the_conversation(page):
    pick(page, "demo.png", DEMO_PNG)
    set_options(page, max_tokens=40, temperature=0)
    with page.expect_response("**/v1/chat") as first_response:
        ask(page, "What is in this picture?")
    first = usage_numbers(finished_turn(page, 1))
    conversation_id = json.loads(first_response.value.text().splitlines()[0])["conversation_id"]

    box = page.get_by_label("Question")
    box.fill("And the colours?")
    box.press("Shift+Enter")  # a new line, not a send
    box.press_sequentially("Name them.")
    assert box.input_value() == "And the colours?\nName them."
    assert page.locator(".turn").count() == 1
    with page.expect_request("**/v1/chat") as sent:
        box.press("Enter")
    second = finished_turn(page, 2)
    assert sent.value.headers["x-conversation-id"] == conversation_id  # Nginx's affinity key
    assert upload_bytes(sent.value) < len(DEMO_PNG) / 4  # only the new question: the server has the picture
    expect(second.locator(".question")).to_have_text("And the colours?\nName them.")
    # The server answered with the first turn in the prompt: picture, question and answer.
    assert usage_numbers(second)["prompt"] > first["prompt"] + first["completion"]
    save_screenshot(page, "web-page.png", for_readme=True)


def test_a_follow_up_shows_the_tokens_that_came_from_the_cache(page):
    pick(page, "seed3.png", encode(pattern(320, 256, seed=3), ".png"))
    set_options(page, max_tokens=12)
    ask(page, "Describe it.")
    first = usage_numbers(finished_turn(page, 1))
    ask(page, "More.")
    second = usage_numbers(finished_turn(page, 2))
    assert second["cached"] > first["prompt"] // 2  # at least the picture's tokens were reused
    expect(page.locator(".turn").nth(1).locator(".usage")).to_contain_text(f"{second['cached']} from cache")


def test_a_new_conversation_forgets_the_old_one(page):
    set_options(page, max_tokens=4)
    ask(page, "Hello.")
    first = usage_numbers(finished_turn(page, 1))
    page.get_by_role("button", name="New conversation").click()
    expect(page.locator(".turn")).to_have_count(0)
    with page.expect_request("**/v1/chat") as sent:
        ask(page, "Hello.")
    again = usage_numbers(finished_turn(page, 1))
    assert "x-conversation-id" not in sent.value.headers
    assert again["prompt"] == first["prompt"]  # the same prompt alone: no history in front of it


def test_stop_ends_the_generation_on_the_server_and_the_next_question_is_answered(page, server):
    cancelled_before = metric(server, "qwen3vl_generations_total", 'finish_reason="cancelled"')
    tokens_before = metric(server, "qwen3vl_generated_tokens_total")
    set_options(page, max_tokens=1400, temperature=0)
    stop_at_first_text(page)
    ask(page, "Write forever.")  # its greedy answer runs to max_tokens (no end of turn before 1,400)
    answer = page.locator(".turn .answer").first
    stop = page.get_by_role("button", name="Stop")
    expect(page.locator(".turn .note")).to_contain_text("Stopped")
    expect(answer).not_to_be_empty()
    expect(stop).to_be_disabled()
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    assert page.locator(".turn .usage").count() == 0
    shown = len(answer.inner_text())
    deadline = time.monotonic() + 10
    while metric(server, "qwen3vl_generations_total", 'finish_reason="cancelled"') == cancelled_before:
        assert time.monotonic() < deadline, "the server did not stop generating"
        time.sleep(0.05)
    assert metric(server, "qwen3vl_generated_tokens_total") - tokens_before < 1400
    assert len(answer.inner_text()) == shown  # nothing arrived after the stop

    set_options(page, max_tokens=5)
    ask(page, "Still there?")
    assert usage_numbers(finished_turn(page, 2, timeout=20_000))["completion"] == 5


def test_a_file_that_is_not_a_picture_gets_the_servers_message(page, server):
    notes = b"shopping list: milk, eggs\n"
    expected = requests.post(
        server + "/v1/chat", files=[("image", ("notes.txt", notes, "text/plain"))], data={"prompt": "x"}
    ).json()["error"]["message"]
    pick(page, "notes.txt", notes, "text/plain")
    expect(page.locator(".preview .note")).to_contain_text("cannot read this as a picture")
    ask(page, "What is this?")
    error = page.get_by_role("alert")
    expect(error).to_contain_text(f"“notes.txt”: {expected}")
    expect(error).to_contain_text("HTTP 400")
    expect(page.get_by_role("button", name="Send")).to_be_enabled()


def test_the_api_key_is_sent_as_a_bearer_token_and_kept_in_this_tab_only(page, browser, server):
    show_options(page)
    key = page.get_by_label("API key")
    expect(key).to_have_attribute("type", "password")
    key.fill("sk-try-123")
    with page.expect_request("**/v1/models") as models:
        key.press("Tab")  # "change": the page re-reads the model with the key
    assert models.value.headers["authorization"] == "Bearer sk-try-123"
    set_options(page, max_tokens=2)
    with page.expect_request("**/v1/chat") as sent:
        ask(page, "Hello?")
    assert sent.value.headers["authorization"] == "Bearer sk-try-123"
    assert page.evaluate("[sessionStorage.length, localStorage.length]") == [1, 0]
    page.reload()
    expect(page.get_by_label("API key")).to_have_value("sk-try-123")
    other = browser.new_context().new_page()
    other.goto(server + "/")
    expect(other.get_by_label("API key")).to_have_value("")
    other.context.close()


def test_the_page_reads_on_a_phone_and_every_control_has_a_label(page):
    page.set_viewport_size({"width": 375, "height": 740})
    pick(page, "a-picture-with-a-rather-long-file-name-that-must-wrap-on-a-small-screen.png", DEMO_PNG)
    set_options(page, max_tokens=60)
    ask(page, "What is in this picture?")
    finished_turn(page, 1)
    assert page.evaluate("document.documentElement.scrollWidth") <= 375
    unlabelled = page.evaluate("""[...document.querySelectorAll('input, textarea, select')]
        .filter(e => e.labels.length === 0).map(e => e.id)""")
    assert unlabelled == []
    send = page.get_by_role("button", name="Send")
    send.scroll_into_view_if_needed()
    box = send.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 375
    save_screenshot(page, "web-page-phone.png")


def test_on_a_server_with_api_keys_the_page_asks_for_one_and_then_answers(browser, keyed_server):
    base, _ = keyed_server
    context = browser.new_context()
    page = context.new_page()
    page.goto(base + "/")
    expect(page.locator("#model-info")).to_contain_text("needs an API key", timeout=60_000)
    key = page.get_by_label("API key")
    expect(key).to_be_visible()  # the options opened by themselves
    key.fill("sk-wrong")
    key.press("Tab")
    ask(page, "Hello?")
    expect(page.get_by_role("alert")).to_contain_text("missing or invalid API key")
    assert "sk-wrong" not in page.get_by_role("alert").inner_text()
    key.fill(KEY)
    key.press("Tab")
    expect(page.locator("#random-banner")).to_be_visible(timeout=60_000)
    set_options(page, max_tokens=3)
    ask(page, "Hello?")
    assert usage_numbers(finished_turn(page, 2))["completion"] == 3
    context.close()
