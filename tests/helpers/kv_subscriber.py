"""A KV-event subscriber written from vLLM's documented format, for tests (real ZMQ sockets).

The structs are vLLM's declarations (vllm/distributed/kv_events.py): msgspec decodes our payloads
strictly against them (tags, field names, types), and re-encoding them with msgspec must give our
bytes back, byte for byte. Replay follows vLLM's ROUTER protocol.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

END_SEQ = -1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


@dataclass
class Message:
    seq: int
    payload: bytes
    batch: KVEventBatch


def flatten(messages: list[Message]) -> list[tuple[Any, ...]]:
    """One record per block, in order: ("stored", hash, parent, tokens) / ("removed", hash) / ("cleared",)."""
    out: list[tuple[Any, ...]] = []
    for m in messages:
        for ev in m.batch.events:
            if isinstance(ev, BlockStored):
                parent, b = ev.parent_block_hash, ev.block_size
                for i, h in enumerate(ev.block_hashes):
                    out.append(("stored", h, parent, tuple(ev.token_ids[i * b:(i + 1) * b])))
                    parent = h
            elif isinstance(ev, BlockRemoved):
                out.extend(("removed", h) for h in ev.block_hashes)
            else:
                out.append(("cleared",))
    return out


class Subscriber:
    """`server_key` (the publisher's Z85 public key) makes it a CURVE client, with the key pair `client` (Z85
    public, secret) or a fresh one."""

    def __init__(self, endpoint: str, topic: str = "", server_key: str | None = None,
                 client: tuple[bytes, bytes] | None = None) -> None:
        self.ctx = zmq.Context()
        self.topic = topic.encode()
        self.curve = (server_key.encode(), *(client or zmq.curve_keypair())) if server_key is not None else None
        self.sub = self._socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(endpoint)
        self.received: list[Message] = []

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = self.curve
        return sock

    def poll(self, timeout: float = 0.2) -> list[Message]:
        """Receives what arrives within `timeout` seconds of quiet."""
        new: list[Message] = []
        while self.sub.poll(int(timeout * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic
            new.append(Message(int.from_bytes(seq, "big"), payload, DECODER.decode(payload)))
        self.received.extend(new)
        return new

    def wait_for(self, cond: Any, timeout: float = 10.0) -> list[Message]:
        deadline = time.monotonic() + timeout
        while not cond(self.received):
            assert time.monotonic() < deadline, f"events never arrived; got {flatten(self.received)}"
            self.poll(0.05)
        return self.received

    def replay(self, endpoint: str, start: int, timeout: float = 10.0) -> list[Message]:
        """Asks the publisher's ROUTER for every buffered batch from `start`, until END_SEQ."""
        req = self._socket(zmq.DEALER)
        req.connect(endpoint)
        try:
            req.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[Message] = []
            while True:
                assert req.poll(int(timeout * 1000)), "replay timed out"
                empty, seq, payload = req.recv_multipart()
                assert empty == b""
                n = int.from_bytes(seq, "big", signed=True)
                if n == END_SEQ:
                    assert payload == b""
                    return out
                out.append(Message(n, payload, DECODER.decode(payload)))
        finally:
            req.close()

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}      # 127.0.0.1, ::ffff:127.0.0.1 in /proc/net/tcp*


def listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) with a TCP socket listening on `port`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                out.add(address)
    return out
