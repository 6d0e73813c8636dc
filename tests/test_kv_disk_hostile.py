"""The disk tier under hostile conditions, as a careful operator probes it, through real Gunicorn
instances on the embedded model (INT8, temperature 0): a valid block of another conversation under
this one's name, a FIFO and a directory where a block should be, a KV_DISK_DIR that is a file, and two
instances writing and reading one folder at once. Every answer is compared with a server without
caches: its tokens (their bytes) and every log-probability with its alternatives, floats as sent.

Two instances (`pair`) share a folder: the first answers a conversation's first turn, the test
damages the files it wrote, the second — which never saw the conversation, as after a restart —
answers the second turn.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from imaging import data_url, encode, pattern
from servers import metric

ANSWER_TOKENS = 8


@dataclass
class Pair:
    folder: Path
    first: str  # base URLs
    second: str
    second_log: Path


@pytest.fixture(scope="module")
def fresh(serve) -> str:
    """A server that computes every prompt in full: the reference."""
    with serve({"CACHE_ENABLED": "false"}, "kv-hostile-fresh") as (base, _):
        yield base


@pytest.fixture(scope="module")
def pair(serve, tmp_path_factory) -> Pair:
    folder = tmp_path_factory.mktemp("kv-hostile")
    env = {"KV_DISK_DIR": str(folder)}
    with serve(env, "kv-hostile-1") as (first, _), serve(env, "kv-hostile-2") as (second, _):
        yield Pair(folder, first, second, serve.log("kv-hostile-2"))


def picture(seed: int) -> dict:
    """A 320×256 picture: every seed gives the same tokens, other pixels."""
    return {"type": "image_url", "image_url": {"url": data_url(encode(pattern(320, 256, seed=seed), ".png"))}}


def first_turn_messages(seed: int, question: str) -> list[dict]:
    return [{"role": "user", "content": [picture(seed), {"type": "text", "text": question}]}]


def ask(base: str, messages: list[dict], timeout: float = 60) -> dict:
    """A stateless native request (the whole history sent), greedy, with log-probabilities: its done line."""
    body = {"messages": messages, "max_tokens": ANSWER_TOKENS, "temperature": 0, "logprobs": True, "top_logprobs": 5}
    response = requests.post(base + "/v1/chat", json=body, timeout=timeout)
    lines = [json.loads(line) for line in response.iter_lines() if line]
    assert lines and lines[-1].get("done"), lines[-1:]
    return lines[-1]


def bits(done: dict) -> list:
    """Each answer token's bytes and log-probability, and its alternatives', as the server sent them."""
    return [
        (t["bytes"], t["logprob"], [(a["bytes"], a["logprob"]) for a in t["top_logprobs"]]) for t in done["logprobs"]
    ]


def then(messages: list[dict], done: dict, question: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": done["text"]}, {"role": "user", "content": question}]


def written(base: str, timeout: float = 30) -> None:
    """Wait until the instance's queued disk writes are done."""
    deadline = time.monotonic() + timeout
    while metric(base, "qwen3vl_kv_disk_pending_writes") > 0:
        assert time.monotonic() < deadline, "writes still pending"
        time.sleep(0.05)


def first_blocks(folder: Path) -> dict[Path, dict]:
    """Each block file holding a conversation's first tokens, and its header."""
    found = {}
    for path in folder.glob("*/*.kv"):
        if not path.is_file():
            continue
        data = path.read_bytes()
        (size,) = struct.unpack("<I", data[8:12])
        header = json.loads(data[12 : 12 + size])
        if header["start"] == 0:
            found[path] = header
    return found


def first_turn_written(pair: Pair, messages: list[dict]) -> tuple[dict, Path]:
    """The first instance answers `messages`; its done line and the file of the conversation's first block."""
    before = set(first_blocks(pair.folder))
    done = ask(pair.first, messages)
    written(pair.first)
    (path,) = set(first_blocks(pair.folder)) - before
    return done, path


def log_text(path: Path, since: int = 0) -> str:
    return path.read_bytes()[since:].decode(errors="replace")


def test_a_valid_block_of_another_conversation_under_this_ones_name_is_not_used(pair, fresh):
    """Two conversations with the same text and pictures of the same size (the same tokens): B's first
    block copied over A's is removed unused, and A's second turn has the bits of a fresh computation."""
    question = "Which of the two is this one? Describe it."
    a_messages, b_messages = first_turn_messages(21, question), first_turn_messages(22, question)
    a_done, a_block = first_turn_written(pair, a_messages)
    _, b_block = first_turn_written(pair, b_messages)
    assert a_block.name != b_block.name
    shutil.copyfile(b_block, a_block)
    rejected = metric(pair.second, "qwen3vl_kv_disk_rejected_files_total", 'reason="corrupt"')
    log_start = pair.second_log.stat().st_size
    follow = then(a_messages, a_done, "And its colours?")
    done = ask(pair.second, follow)
    assert done["usage"]["cached_from"] != "disk"
    assert metric(pair.second, "qwen3vl_kv_disk_rejected_files_total", 'reason="corrupt"') == rejected + 1
    assert "another block's content: other pictures or clips" in log_text(pair.second_log, log_start)
    reference = ask(fresh, follow)
    assert done["text"] == reference["text"] and bits(done) == bits(reference)


def test_a_fifo_where_a_block_should_be_stalls_nothing(pair, fresh):
    """A FIFO under a block's name is never opened for reading: the turn and an unrelated newcomer
    answer at once (before, the one reader thread hung on its open, and every disk lookup behind it)."""
    messages = first_turn_messages(31, "What does the FIFO hide?")
    done, block = first_turn_written(pair, messages)
    block.unlink()
    os.mkfifo(block)
    log_start = pair.second_log.stat().st_size
    follow = then(messages, done, "Go on.")
    started = time.monotonic()
    second = ask(pair.second, follow, timeout=20)
    newcomer = ask(pair.second, first_turn_messages(32, "Something unrelated."), timeout=20)
    assert time.monotonic() - started < 15
    assert second["usage"]["cached_from"] != "disk" and newcomer["usage"]["completion_tokens"] > 0
    reference = ask(fresh, follow)
    assert second["text"] == reference["text"] and bits(second) == bits(reference)
    written(pair.second)
    assert block.is_file() and not block.is_symlink()  # the FIFO removed, the block written in its place
    assert "Traceback" not in log_text(pair.second_log, log_start)


def test_a_directory_where_a_block_should_be_is_skipped_without_a_traceback_and_replaced(pair, fresh):
    messages = first_turn_messages(41, "Where is the directory?")
    done, block = first_turn_written(pair, messages)
    block.unlink()
    block.mkdir()
    log_start = pair.second_log.stat().st_size
    follow = then(messages, done, "Say more.")
    second = ask(pair.second, follow)
    reference = ask(fresh, follow)
    assert second["usage"]["cached_from"] != "disk"
    assert second["text"] == reference["text"] and bits(second) == bits(reference)
    written(pair.second)
    assert block.is_file()  # the empty directory removed, the block written in its place
    log = log_text(pair.second_log, log_start)
    assert "Traceback" not in log and f"removed {block} (not_a_file: a directory)" in log
    third = ask(pair.first, then(follow, second, "Once more."))  # the block serves again
    assert third["usage"]["cached_from"] == "disk"


def test_a_kv_disk_dir_that_is_a_file_turns_the_tier_off_and_the_model_still_serves(serve, fresh, tmp_path):
    not_a_folder = tmp_path / "kv"
    not_a_folder.write_text("a file where the folder should be")
    with serve({"KV_DISK_DIR": str(not_a_folder)}, "kv-hostile-file", timeout=60) as (base, _):
        assert requests.get(base + "/ready", timeout=10).status_code == 200
        assert metric(base, "qwen3vl_kv_disk_usable") == 0
        messages = first_turn_messages(51, "Is the disk tier off?")
        done = ask(base, messages)
        follow = then(messages, done, "And now?")
        second = ask(base, follow)
        assert second["usage"]["cached_from"] == "memory"  # the memory tier still serves
        for answer, asked in ((done, messages), (second, follow)):
            reference = ask(fresh, asked)
            assert answer["text"] == reference["text"] and bits(answer) == bits(reference)
    log = log_text(serve.log("kv-hostile-file"))
    assert log.count("KV disk tier off") == 1 and "Traceback" not in log
    assert not_a_folder.read_text() == "a file where the folder should be"


def test_two_instances_share_one_folder_at_once_and_a_restarted_one_continues_the_others(pair, fresh, serve):
    """Both instances answer the same conversation and one each at the same time (writing the same and
    different blocks into one folder), each continues one the other began, then a restarted instance
    continues a conversation the other began: every answer has the bits of a fresh computation."""
    both = first_turn_messages(61, "Both of us see this.")
    own = {
        pair.first: first_turn_messages(62, "Only the first sees this."),
        pair.second: first_turn_messages(63, "Only the second."),
    }
    asked = [(pair.first, both), (pair.second, both), (pair.first, own[pair.first]), (pair.second, own[pair.second])]
    answers: list[dict | None] = [None] * len(asked)

    def send(i: int) -> None:
        answers[i] = ask(*asked[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(asked))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(answers)
    reference = ask(fresh, both)
    assert bits(answers[0]) == bits(answers[1]) == bits(reference)
    written(pair.first)
    written(pair.second)
    checks = []
    for (base, messages), done in zip(asked[2:], answers[2:]):
        other = pair.second if base == pair.first else pair.first
        follow = then(messages, done, "Continue.")
        checks.append((ask(other, follow), follow))
    for continued, follow in checks:
        assert continued["usage"]["cached_from"] == "disk"
        reference = ask(fresh, follow)
        assert continued["text"] == reference["text"] and bits(continued) == bits(reference)
    written(pair.first)
    written(pair.second)
    began, follow = checks[0]  # the first instance's conversation, continued by the second
    later = then(follow, began, "And finally?")
    with serve({"KV_DISK_DIR": str(pair.folder)}, "kv-hostile-restarted") as (restarted, _):
        done = ask(restarted, later)
    assert done["usage"]["cached_from"] == "disk" and done["usage"]["cached_tokens"] >= began["usage"]["prompt_tokens"]
    reference = ask(fresh, later)
    assert done["text"] == reference["text"] and bits(done) == bits(reference)
