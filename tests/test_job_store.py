"""The job store's rules (service/jobs/store.py) on the real backends: leases, a dead instance's line
taken again, a result written once, attempts bounded, cancel and expiry keeping what finished, the
output and error files in input order."""

from __future__ import annotations

import json
import threading
import time

import pytest

from service.jobs.redis import RedisStore
from service.jobs.sqlite import SqliteStore
from service.jobs.store import Line, NewBatch, failed_line, new_id, result_line


@pytest.fixture(params=["sqlite", "redis"])
def store(request, tmp_path):
    if request.param == "sqlite":
        made = SqliteStore(tmp_path / "jobs.sqlite3", max_attempts=2)
    else:
        made = RedisStore(request.getfixturevalue("redis_url"), max_attempts=2)
        made.client.flushdb()
    yield made
    made.close()


def new_batch(lines: int, owner: str = "", window: int = 3600, bad: tuple[int, ...] = ()) -> NewBatch:
    unreadable = {i: failed_line(f"c{i}", "invalid_request_line", "bad") for i in bad}
    made = [Line(i, f"c{i}", "" if i in bad else "{}", unreadable.get(i)) for i in range(lines)]
    return NewBatch(new_id("batch_"), owner, "/v1/chat/completions", "file-x", "24h", window, None, made)


def answer(claim) -> str:
    return result_line(claim.custom_id, 200, {"text": f"answer to {claim.custom_id}"})


def output(store, record, key) -> list[dict]:
    content = store.file_content(record[key], record["owner"])
    return [json.loads(line) for line in content.decode().splitlines()]


def test_lines_run_in_order_and_the_last_one_writes_the_files(store):
    batch = store.create_batch(new_batch(3, bad=(1,)))
    assert batch["status"] == "in_progress" and (batch["total"], batch["failed"]) == (3, 1)
    claims = [store.claim("w1", 60), store.claim("w1", 60)]
    assert [c.custom_id for c in claims] == ["c0", "c2"] and store.claim("w1", 60) is None
    for claim in reversed(claims):
        assert store.finish(claim, True, answer(claim))
    done = store.batch(batch["id"], "")
    assert done["status"] == "completed" and (done["completed"], done["failed"]) == (2, 1)
    assert [line["custom_id"] for line in output(store, done, "output_file_id")] == ["c0", "c2"]  # input order
    [error] = output(store, done, "error_file_id")
    assert error["custom_id"] == "c1" and error["error"]["code"] == "invalid_request_line"


def test_a_dead_instances_line_runs_again_and_its_result_is_written_once(store):
    batch = store.create_batch(new_batch(1))
    first = store.claim("dead", 0.2)
    assert store.claim("alive", 60) is None  # leased
    time.sleep(0.3)
    second = store.claim("alive", 60)
    assert (second.custom_id, second.attempt) == ("c0", 2)
    assert not store.renew(first, 60)  # the first instance lost it...
    assert not store.finish(first, True, answer(first))  # ...and cannot write it
    assert store.finish(second, True, answer(second))
    assert not store.finish(second, True, answer(second))  # once
    done = store.batch(batch["id"], "")
    assert done["status"] == "completed" and done["completed"] == 1
    assert len(output(store, done, "output_file_id")) == 1


def test_a_line_whose_instances_keep_dying_fails_after_its_attempts(store):
    batch = store.create_batch(new_batch(1))
    for _ in range(2):  # max_attempts
        assert store.claim("dying", 0.05) is not None
        time.sleep(0.1)
    assert store.claim("next", 60) is None
    done = store.batch(batch["id"], "")
    assert done["status"] == "completed" and done["failed"] == 1
    [error] = output(store, done, "error_file_id")
    assert error["error"]["code"] == "attempts_exhausted"


def test_a_line_given_back_untried_is_claimed_again_without_using_an_attempt(store):
    store.create_batch(new_batch(1))
    for _ in range(3):
        claim = store.claim("busy", 60)
        assert claim.attempt == 1
        store.release(claim)


def test_cancel_keeps_what_finished_and_stops_the_rest(store):
    batch = store.create_batch(new_batch(3))
    finished, running = store.claim("w", 60), store.claim("w", 60)
    store.finish(finished, True, answer(finished))
    cancelling = store.cancel(batch["id"], "")
    assert cancelling["status"] == "cancelling"  # a line still runs
    assert not store.renew(running, 60)  # its runner sees the cancel...
    store.release(running)  # ...and stops it
    done = store.batch(batch["id"], "")
    assert done["status"] == "cancelled" and done["cancelled_at"] and (done["completed"], done["failed"]) == (1, 0)
    assert [line["custom_id"] for line in output(store, done, "output_file_id")] == ["c0"]
    assert store.claim("w", 60) is None


def test_a_batch_past_its_window_expires_and_its_unrun_lines_fail(store):
    batch = store.create_batch(new_batch(2, window=0))
    time.sleep(1.1)
    assert store.claim("w", 60) is None
    done = store.batch(batch["id"], "")
    assert done["status"] == "expired" and done["failed"] == 2
    assert {line["error"]["code"] for line in output(store, done, "error_file_id")} == {"batch_expired"}


def test_owners_see_only_their_own_batches(store):
    mine = store.create_batch(new_batch(1, owner="a"))
    assert store.batch(mine["id"], "b") is None and store.cancel(mine["id"], "b") is None
    assert [b["id"] for b in store.batches("a", 10, None)] == [mine["id"]] and store.batches("b", 10, None) == []
    assert store.active_batches("a") == 1 and store.active_batches("b") == 0


def test_two_instances_claiming_at_once_never_lease_a_line_twice(store):
    """Two instances' stores on one file or one Redis (two connections), claiming from two threads at once."""
    store.create_batch(new_batch(40))
    taken: list[str] = []

    def take(worker, each):
        while (claim := each.claim(worker, 60)) is not None:
            taken.append(claim.custom_id)

    other = SqliteStore(store.path) if isinstance(store, SqliteStore) else RedisStore(store.url)
    threads = [threading.Thread(target=take, args=(w, s)) for w, s in (("a", store), ("b", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(taken) == sorted(f"c{i}" for i in range(40))


def test_a_restart_of_redis_loses_no_job_and_no_finished_result(tmp_path):
    """Redis written as it changes (appendonly, as docs/deployment.md configures it): stopped and
    started again on the same folder, it still has the batch, its finished line and its pending one."""
    from servers import free_port, redis_server

    folder, port = tmp_path / "redis-data", free_port()
    folder.mkdir()
    with redis_server(tmp_path / "redis.log", folder, port) as url:
        store = RedisStore(url)
        batch = store.create_batch(new_batch(2))
        claim = store.claim("w", 60)
        assert store.finish(claim, True, answer(claim))
        store.close()
    with redis_server(tmp_path / "redis.log", folder, port) as url:
        store = RedisStore(url)
        kept = store.batch(batch["id"], "")
        assert kept["status"] == "in_progress" and kept["completed"] == 1
        last = store.claim("w", 60)
        assert last.custom_id == "c1" and store.finish(last, True, answer(last))
        done = store.batch(batch["id"], "")
        assert [line["custom_id"] for line in output(store, done, "output_file_id")] == ["c0", "c1"]
        store.close()
