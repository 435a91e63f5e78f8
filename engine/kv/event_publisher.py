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

Exposure: every BlockStored carries a prompt's token ids, so whoever can subscribe reads every client's
prompts (a confidential system prompt decodes from them), and the replay socket hands out the last
`buffer_steps` batches on request. The default endpoint is loopback; a socket bound on another interface
is logged as a warning at start unless CURVE is on. CURVE (`CurveKeys`, from EngineConfig's
kv_events_secret_key / kv_events_client_keys): both sockets are CURVE servers with this secret key, so a
subscriber must know the server's public key (logged at start) to complete the handshake, traffic is
encrypted, and with client keys listed a ZAP handler admits only those subscribers' public keys.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import zmq
from zmq.auth.thread import ThreadAuthenticator

from engine.kv.events import KVEventQueue, KVEventsConfig, encode_batch, events_of

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


ZAP_DOMAIN = "kv-events"                # the ZAP handler answers for this domain only
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")
_LOOPBACK = ("localhost", "::1", "[::1]")


def _host(endpoint: str) -> str:
    """The host of a tcp:// endpoint (`tcp://HOST:PORT`, `tcp://[V6]:PORT`); "" for ipc/inproc."""
    if not endpoint.startswith("tcp://"):
        return ""
    return endpoint[len("tcp://"):].rsplit(":", 1)[0].lower()


def is_loopback(endpoint: str) -> bool:
    host = _host(endpoint)
    return host in _LOOPBACK or host.startswith("127.")


def binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB endpoint, plus loopback: bind a wildcard host (*, ::), a loopback host or an
    ipc/inproc path, else connect (to a collector that binds). vLLM connects to a loopback host; binding it
    here is what lets the default, tcp://127.0.0.1:5557, serve subscribers on this host only."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
            or is_loopback(endpoint) or _host(endpoint) in _WILDCARDS)


def exposed(endpoint: str) -> bool:
    """Whether a bound endpoint accepts subscribers from other hosts (a tcp host that is not loopback)."""
    return endpoint.startswith("tcp://") and not is_loopback(endpoint)


@dataclass(frozen=True)
class CurveKeys:
    """The KV event sockets' CURVE keys (Z85 text): this server's key pair and the public keys of the
    subscribers it admits (empty: any subscriber that knows the server's public key)."""

    secret_key: str
    client_keys: tuple[str, ...] = ()
    public_key: str = field(init=False)

    def __post_init__(self) -> None:
        if not zmq.has("curve"):
            raise ValueError("kv_events_secret_key: this libzmq was built without CURVE (libsodium)")
        for name, key in [("kv_events_secret_key", self.secret_key),
                          *(("kv_events_client_keys", k) for k in self.client_keys)]:
            try:
                ok = len(key) == 40 and len(zmq.utils.z85.decode(key)) == 32
            except (ValueError, KeyError, TypeError, OverflowError):
                ok = False
            if not ok:
                raise ValueError(f"{name}: a CURVE key is 40 characters of Z85 (zmq.curve_keypair() makes one)")
        object.__setattr__(self, "public_key", zmq.curve_public(self.secret_key.encode()).decode())

    def __repr__(self) -> str:          # never the secret key, in a log or a traceback
        return f"CurveKeys(public_key={self.public_key!r}, client_keys={len(self.client_keys)})"

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP handler's question: may this subscriber (its Z85 public key) connect?"""
        return key.decode() in self.client_keys


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, queue: KVEventQueue, block_size: int,
                 data_parallel_rank: int = 0, interval: float = 0.01, curve: CurveKeys | None = None) -> None:
        self.config = config
        self.curve = curve
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
        auth: ThreadAuthenticator | None = None
        try:
            try:
                if self.curve is not None and self.curve.client_keys:
                    auth = ThreadAuthenticator(ctx)       # the ZAP handler, started before any socket binds
                    auth.start()
                    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self.curve)
                pub = self._socket(ctx, zmq.PUB)
                pub.set_hwm(self.config.hwm)
                (pub.bind if binds(self.config.endpoint) else pub.connect)(self.config.endpoint)
                if self.config.replay_endpoint is not None:
                    replay = self._socket(ctx, zmq.ROUTER)
                    replay.bind(self.config.replay_endpoint)
            except zmq.ZMQError as exc:
                self._error = exc
                return
            finally:
                self._ready.set()
            self._announce()
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
            if auth is not None:
                auth.stop()
            ctx.term()

    def _socket(self, ctx: zmq.Context, kind: int) -> zmq.Socket:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            sock.curve_secretkey = self.curve.secret_key.encode()
            sock.curve_publickey = self.curve.public_key.encode()
            sock.curve_server = True
            sock.zap_domain = ZAP_DOMAIN.encode()
        return sock

    def _announce(self) -> None:
        endpoints = [e for e in (self.config.endpoint, self.config.replay_endpoint) if e is not None]
        if self.curve is not None:
            log.info("KV events: CURVE on %s; server public key %s; %s", ", ".join(endpoints), self.curve.public_key,
                     f"{len(self.curve.client_keys)} subscriber key(s) admitted" if self.curve.client_keys else
                     "any subscriber that knows the public key is admitted")
            return
        for e in endpoints:
            if (e is self.config.replay_endpoint or binds(e)) and exposed(e):
                log.warning("KV events: %s is bound beyond loopback, without CURVE: whoever reaches it reads every "
                            "client's prompt token ids (BlockStored) and the replay history; bind 127.0.0.1, or "
                            "set kv_events_secret_key (README, KV cache events)", e)

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
