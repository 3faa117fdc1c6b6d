"""The batch store (SQLite): a submit is all or nothing, a request's result is recorded exactly once, a store
reopened after its process died (no close, as after a SIGKILL) continues where it stopped, an unwritable or
taken store refuses clearly, and an ended batch's output and error files hold its lines in input order."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from kunserve.services.dispatcher.batch_format import BatchRequest, response_line
from kunserve.services.dispatcher.batch_store import BatchStore, Conflict, NotFound, StoreUnavailable


def requests(n: int) -> list[BatchRequest]:
    return [BatchRequest(i + 1, f"req-{i}", "/v1/completions", {"prompt": f"p{i}", "max_tokens": 2}) for i in range(n)]


def submit(store: BatchStore, n: int = 3, window_s: int = 3600, **kw):
    return store.submit(b"input", "in.jsonl", endpoint="/v1/completions", window="1h", window_s=window_s,
                        requests=requests(n), metadata=kw.get("metadata", {}))


def ok_line(custom_id: str, text: str) -> str:
    return response_line("batch_req_x", custom_id, 200, "rid", {"choices": [{"text": text}]})


def counts(store: BatchStore) -> tuple[int, int, int]:
    db = sqlite3.connect(store.path)
    try:
        return tuple(db.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("files", "batches", "items"))
    finally:
        db.close()


def test_a_submit_is_stored_whole_and_read_back(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3", clock=lambda: 1000.0)
    b = submit(store, 3, metadata={"who": "me"})
    assert (b.status, b.total, b.completed, b.failed) == ("in_progress", 3, 0, 0)
    assert (b.created_at, b.in_progress_at, b.expires_at, b.metadata) == (1000, 1000, 4600, {"who": "me"})
    assert store.file(b.input_file_id).bytes == 5 and store.file_content(b.input_file_id) == b"input"
    assert [i.custom_id for i in store.pending_items(b.id, -1, 10)] == ["req-0", "req-1", "req-2"]
    assert [i.index for i in store.pending_items(b.id, 0, 1)] == [1]
    assert store.pending_items(b.id, -1, 1)[0].body == {"prompt": "p0", "max_tokens": 2}
    assert [x.id for x in store.active_batches()] == [b.id]
    assert counts(store) == (1, 1, 3)


def test_a_submit_that_fails_midway_stores_nothing(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3")
    submit(store, 1)
    bad = requests(3)
    bad[2] = BatchRequest(3, "req-2", "/v1/completions", {"unserializable": {1, 2}})
    with pytest.raises(TypeError):  # after the file row and two requests were inserted
        store.submit(b"input", "in.jsonl", endpoint="/v1/completions", window="1h", window_s=60, requests=bad,
                     metadata={})
    assert counts(store) == (1, 1, 1)
    store._db.execute("PRAGMA query_only = ON")  # the store can no longer be written (as a full or read-only disk)
    with pytest.raises(StoreUnavailable, match=r"dispatcher.batch_db = .*b.sqlite3\) cannot be written"):
        submit(store, 2)
    store._db.execute("PRAGMA query_only = OFF")
    assert counts(store) == (1, 1, 1) and len(store.active_batches()) == 1


def test_results_are_recorded_exactly_once(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3")
    b = submit(store, 3)
    assert store.start_item(b.id, 1) == 1 and store.start_item(b.id, 1) == 2
    assert store.record(b.id, 1, ok_line("req-1", "first"), ok=True)
    assert not store.record(b.id, 1, ok_line("req-1", "second"), ok=True)  # a re-run's result is dropped
    assert not store.record(b.id, 1, ok_line("req-1", "third"), ok=False)
    assert store.record(b.id, 0, response_line("x", "req-0", 400, "rid", {"error": {}}), ok=False)
    got = store.batch(b.id)
    assert (got.completed, got.failed) == (1, 1)
    res = store.results(b.id)
    assert [(r.index, r.ok, r.attempts) for r in res] == [(0, False, 0), (1, True, 2)]
    assert json.loads(res[1].line)["response"]["body"]["choices"][0]["text"] == "first"
    assert [i.index for i in store.pending_items(b.id, -1, 10)] == [2]


CRASH = textwrap.dedent("""
    import os, sys
    from kunserve.services.dispatcher.batch_format import BatchRequest, response_line
    from kunserve.services.dispatcher.batch_store import BatchStore
    store = BatchStore(sys.argv[1])
    reqs = [BatchRequest(i + 1, f"req-{i}", "/v1/completions", {"prompt": str(i)}) for i in range(4)]
    b = store.submit(b"in", "in.jsonl", endpoint="/v1/completions", window="1h", window_s=3600, requests=reqs,
                     metadata={})
    store.start_item(b.id, 0)
    store.record(b.id, 0, response_line("l0", "req-0", 200, "r0", {"text": "zero"}), ok=True)
    store.start_item(b.id, 1)  # running when the process dies
    print(b.id, flush=True)
    os._exit(0)  # no close, no checkpoint: as after a SIGKILL
""")


def test_a_store_reopened_after_its_process_died_continues(tmp_path):
    path = tmp_path / "b.sqlite3"
    out = subprocess.run([sys.executable, "-c", CRASH, str(path)], capture_output=True, text=True, timeout=60, check=True)
    batch_id = out.stdout.strip()
    store = BatchStore(path)
    b = store.batch(batch_id)
    assert (b.status, b.completed, b.total) == ("in_progress", 1, 4)
    pending = store.pending_items(batch_id, -1, 10)
    assert [i.index for i in pending] == [1, 2, 3]  # the one that was running runs again
    assert store.start_item(batch_id, 1) == 2
    for i in (1, 2, 3):
        assert store.record(batch_id, i, ok_line(f"req-{i}", str(i)), ok=True)
    done = store.finish(batch_id, "completed")
    assert (done.status, done.completed, done.failed, done.error_file_id) == ("completed", 4, 0, None)
    lines = [json.loads(x) for x in store.file_content(done.output_file_id).decode().splitlines()]
    assert [x["custom_id"] for x in lines] == ["req-0", "req-1", "req-2", "req-3"]
    assert lines[0]["response"]["body"] == {"text": "zero"}


def test_an_ended_batch_writes_its_files_in_input_order(tmp_path):
    now = [1000.0]
    store = BatchStore(tmp_path / "b.sqlite3", clock=lambda: now[0])
    b = submit(store, 4)
    store.record(b.id, 2, ok_line("req-2", "two"), ok=True)
    store.record(b.id, 0, response_line("x", "req-0", 400, "r", {"error": {"message": "bad"}}), ok=False)
    now[0] = 5000.0
    done = store.finish(b.id, "expired")
    assert (done.status, done.expired_at, done.finalizing_at, done.completed, done.failed) == ("expired", 5000, 5000, 1, 3)
    assert store.finish(b.id, "completed") == done  # ended once
    assert store.active_batches() == []
    out = [json.loads(x) for x in store.file_content(done.output_file_id).decode().splitlines()]
    err = [json.loads(x) for x in store.file_content(done.error_file_id).decode().splitlines()]
    assert [x["custom_id"] for x in out] == ["req-2"]
    assert [x["custom_id"] for x in err] == ["req-0", "req-1", "req-3"]
    assert err[0]["response"]["status_code"] == 400
    assert [x["error"]["code"] for x in err[1:]] == ["batch_expired", "batch_expired"]
    assert store.file(done.output_file_id).purpose == "batch_output"
    assert [(r.index, r.ok) for r in store.results(b.id)] == [(0, False), (1, False), (2, True), (3, False)]
    assert [r.index for r in store.results(b.id, after_index=1, limit=1)] == [2]
    assert not store.record(b.id, 1, ok_line("req-1", "late"), ok=True)  # the batch ended: nothing is pending


def test_cancel_and_its_conflicts(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3", clock=lambda: 7.0)
    b = submit(store, 2)
    c = store.cancel(b.id)
    assert (c.status, c.cancelling_at) == ("cancelling", 7)
    assert store.cancel(b.id) == c
    done = store.finish(b.id, "cancelled")
    assert (done.status, done.cancelled_at, done.failed) == ("cancelled", 7, 2)
    assert store.cancel(b.id).status == "cancelled"
    other = submit(store, 1)
    store.record(other.id, 0, ok_line("req-0", "t"), ok=True)
    store.finish(other.id, "completed")
    with pytest.raises(Conflict, match="is completed; only a batch in progress can be cancelled"):
        store.cancel(other.id)
    with pytest.raises(NotFound, match="no batch 'batch_nope'"):
        store.cancel("batch_nope")


def test_list_pages_newest_first(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3")
    ids = [submit(store, 1).id for _ in range(3)]
    page, more = store.list_batches(2)
    assert [b.id for b in page] == ids[:0:-1] and more
    page, more = store.list_batches(2, after=page[-1].id)
    assert [b.id for b in page] == ids[:1] and not more
    with pytest.raises(NotFound):
        store.list_batches(2, after="batch_nope")


def test_reads_never_create_the_file_and_errors_are_clear(tmp_path):
    path = tmp_path / "b.sqlite3"
    store = BatchStore(path)
    assert store.active_batches() == [] and store.list_batches(5) == ([], False)
    assert store.pending_items("x", -1, 5) == []
    for read in (lambda: store.batch("batch_x"), lambda: store.file("file-x"), lambda: store.results("batch_x")):
        with pytest.raises(NotFound):
            read()
    assert not path.exists() and not store.exists()

    blocked = BatchStore(tmp_path / "not-a-dir" / "b.sqlite3")
    (tmp_path / "not-a-dir").write_text("a file where a directory should be")
    with pytest.raises(StoreUnavailable, match=r"dispatcher.batch_db = .*not-a-dir/b.sqlite3\) cannot be opened"):
        submit(blocked, 1)

    submit(store, 1)
    second = BatchStore(path)  # another dispatcher on the same file
    with pytest.raises(StoreUnavailable, match="is in use by another dispatcher"):
        second.batch("batch_x")
    store.close()
    assert len(second.active_batches()) == 1  # the first one let go
    second.close()

    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 99")
    db.commit()
    db.close()
    with pytest.raises(StoreUnavailable, match="schema version 99"):
        BatchStore(path).active_batches()
