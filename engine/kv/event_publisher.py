"""The ZMQ side of vLLM-format KV events: a PUB socket, an optional ROUTER replay socket, one thread.

Who owns what: the engine thread only appends records to the `KVEventQueue` (the block pool's sink).
This publisher's thread owns both sockets (ZMQ sockets are not thread-safe: they are created, used and
closed on that thread), drains the queue every `interval` seconds (or at once when a replay request
wakes it), encodes one batch per drain and sends it without blocking: a slow or absent subscriber costs
the engine nothing (PUB drops for a subscriber past the high-water mark, and the queue is bounded).

Replay (vLLM's protocol): a client connects a REQ or DEALER socket to `replay_endpoint` and sends
[b"", start_seq as 8 bytes big-endian] (a REQ adds the empty frame itself). The ROUTER answers with
one [b"", seq, payload] per buffered batch with seq >= start_seq (the last `buffer_steps` batches),
then [b"", -1 as 8 signed bytes, b""].
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

import zmq

from engine.kv.events import KVEventQueue, KVEventsConfig, encode_batch, events_of

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB endpoint: bind a wildcard host or an ipc/inproc path, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, queue: KVEventQueue, block_size: int,
                 data_parallel_rank: int = 0, interval: float = 0.01) -> None:
        self.config = config
        self.queue = queue
        self.block_size = block_size
        self.rank = data_parallel_rank
        self.interval = interval
        self.published_batches = 0             # written by the publisher thread only
        self._next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> ZmqEventPublisher:
        """Binds (or connects) on the publisher thread; a socket error (port in use) is raised here."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise RuntimeError(f"KV events: cannot open {self.config.endpoint}"
                               f"{' / ' + self.config.replay_endpoint if self.config.replay_endpoint else ''}: "
                               f"{self._error}") from self._error
        return self

    def close(self) -> None:
        """Publishes what is still queued, then closes the sockets (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    # -- the publisher thread -----------------------------------------------------------------
    def _run(self) -> None:
        ctx = zmq.Context()
        pub = replay = None
        try:
            try:
                pub = ctx.socket(zmq.PUB)
                pub.setsockopt(zmq.LINGER, 0)
                pub.set_hwm(self.config.hwm)
                (pub.bind if binds(self.config.endpoint) else pub.connect)(self.config.endpoint)
                if self.config.replay_endpoint is not None:
                    replay = ctx.socket(zmq.ROUTER)
                    replay.setsockopt(zmq.LINGER, 0)
                    replay.bind(self.config.replay_endpoint)
            except zmq.ZMQError as exc:
                self._error = exc
                return
            finally:
                self._ready.set()
            poller = zmq.Poller()
            if replay is not None:
                poller.register(replay, zmq.POLLIN)
            while True:
                stopping = self._stop.is_set()
                if replay is not None:
                    if poller.poll(int(self.interval * 1000)):
                        self._serve_replay(replay)
                elif not stopping:
                    self._stop.wait(self.interval)
                self._flush(pub)
                if stopping:
                    break
        except Exception:  # never take the engine down; the engine goes on without events
            log.exception("KV event publisher stopped")
        finally:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            ctx.term()

    def _flush(self, pub: zmq.Socket) -> None:
        records = self.queue.drain()
        if not records:
            return
        payload = encode_batch(events_of(records, self.block_size), time.time(), self.rank)
        seq = self._next_seq
        self._next_seq += 1
        try:
            pub.send_multipart((self.config.topic.encode(), seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:       # a connecting PUB with no peer yet: the batch is lost for live readers
            pass
        self._buffer.append((seq, payload))
        self.published_batches += 1

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))
