"""Which transfer links the memory manager asks workers to open ahead of a drop (missing_links)."""

from kunserve.services.memory_manager.servicer import missing_links
from kunserve.v1 import worker_pb2


def _info(wid: str, peers=(), address: str | None = None) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(worker_id=wid, transfer_address=f"127.0.0.1:{7000 + int(wid[-1])}"
                                 if address is None else address, transfer_peers=list(peers))


def test_each_pair_is_opened_once_by_the_smaller_id():
    infos = {w: _info(w) for w in ("w2", "w0", "w1")}
    assert missing_links(infos) == {"w0": {"w1": "127.0.0.1:7001", "w2": "127.0.0.1:7002"},
                                    "w1": {"w2": "127.0.0.1:7002"}}


def test_a_link_either_side_reports_is_not_asked_for_again():
    infos = {"w0": _info("w0", ["w1"]), "w1": _info("w1", ["w0"]), "w2": _info("w2", ["w0"])}
    # w0-w1 linked (both say so); w0-w2 linked (w2 says so, w0's info may be older); w1-w2 missing
    assert missing_links(infos) == {"w1": {"w2": "127.0.0.1:7002"}}


def test_fully_linked_or_no_transfer_service_asks_for_nothing():
    assert missing_links({"w0": _info("w0", ["w1"]), "w1": _info("w1", ["w0"])}) == {}
    assert missing_links({"w0": _info("w0"), "w1": _info("w1", address="")}) == {}
    assert missing_links({}) == {}


def test_a_restarted_worker_is_linked_again():
    # w1 restarted: a new address, no peers; w0 dropped its dead link
    infos = {"w0": _info("w0", ["w2"]), "w1": _info("w1", address="127.0.0.1:9999"), "w2": _info("w2", ["w0"])}
    assert missing_links(infos) == {"w0": {"w1": "127.0.0.1:9999"}, "w1": {"w2": "127.0.0.1:7002"}}
