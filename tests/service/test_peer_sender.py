"""PeerSender: the engine's messages written from a thread of their own, in order per connection, a close after
what was queued before it, and a failed write reported for its connection."""

from __future__ import annotations

import multiprocessing as mp
import threading
from multiprocessing.connection import Connection

from mtpserve.cluster.service.peer_sender import PeerSender


def test_messages_arrive_in_order_then_the_close() -> None:
    broken: list[Connection] = []
    sender = PeerSender(broken.append)
    a_here, a_there = mp.Pipe()
    b_here, b_there = mp.Pipe()
    got: dict[str, list[int]] = {"a": [], "b": []}

    def read(name: str, conn: Connection) -> None:
        try:
            while True:
                got[name].append(conn.recv()[1])
        except EOFError:
            got[name].append(-1)  # the close

    readers = [threading.Thread(target=read, args=(n, c)) for n, c in (("a", a_there), ("b", b_there))]
    for t in readers:
        t.start()
    try:
        for i in range(2000):
            sender.send(a_here, ("out", i, list(range(i % 7))))
            sender.send(b_here, ("out", 5000 + i))
        sender.close(a_here)
        assert sender.flush()
        readers[0].join(10.0)
        assert got["a"] == [*range(2000), -1]
        assert a_here.closed and not b_here.closed
        b_here.close()
        readers[1].join(10.0)
        assert got["b"] == [*range(5000, 7000), -1]
        assert broken == []
    finally:
        sender.stop()


def test_a_failed_write_names_its_connection_and_the_others_still_go_out() -> None:
    broken: list[Connection] = []
    sender = PeerSender(broken.append)
    gone_here, gone_there = mp.Pipe()
    ok_here, ok_there = mp.Pipe()
    gone_there.close()
    try:
        sender.send(gone_here, ("out", 1))
        sender.send(ok_here, ("out", 2))
        assert sender.flush()
        assert broken == [gone_here]
        assert ok_there.recv() == ("out", 2)
    finally:
        sender.stop()


def test_stop_ends_the_thread_after_what_was_queued() -> None:
    sender = PeerSender(lambda _conn: None)
    here, there = mp.Pipe()
    sender.send(here, ("last",))
    sender.stop()
    assert there.recv() == ("last",)
    assert not sender._thread.is_alive()
