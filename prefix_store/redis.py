"""RedisPrefixStore: the registry every replica shares through one Redis (redis.asyncio, msgpack values).

Keys, with ns the namespace and fp the model fingerprint:

    {ns}:prefix:{fp}:{key}    msgpack PrefixRecord (key: PrefixRecord.key), expiring at a lease's end
    {ns}:prefixes:{fp}        set of the keys registered for fp (an expired key's entry is left for
                              the replicas' expiry sweep to remove)
    {ns}:fingerprints         set of the fingerprints with at least one name
    {ns}:replica:{id}         msgpack ReplicaInfo, expiring (SET ... PX ttl): a liveness key
    {ns}:events               pub/sub channel of msgpack PrefixEvent announcements

Writes are compare-and-set transactions: WATCH the keys read, check, then MULTI / writes / PUBLISH /
EXEC, retried on WatchError. The announcement is part of the transaction, so it goes out iff the
write committed. Redis is never on the per-token path; when it is down every call raises
StoreUnavailable and `events()` waits for it to come back.
"""
from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import msgpack
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError, WatchError

from prefix_store.base import PrefixEvent, PrefixRecord, ReplicaInfo
from prefix_store.errors import PrefixConflict, StoreUnavailable

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_NAMESPACE = "prefixserve"
_TX_ATTEMPTS = 16             # WatchError retries before giving up on a write (only under heavy churn)
_POLL_S = 0.5                 # how often a quiet events() iterator checks whether the store was closed
_BACKOFF_MIN_S = 0.05         # events() resubscribe backoff, doubled per failure up to the max
_BACKOFF_MAX_S = 2.0
_BACKEND_ERRORS = (RedisError, OSError)  # OSError covers refused connections and asyncio timeouts


def _pack(obj: dict[str, Any]) -> bytes:
    return cast(bytes, msgpack.packb(obj, use_bin_type=True))


def _unpack(raw: bytes | str) -> dict[str, Any]:
    if isinstance(raw, str):  # only with decode_responses=True, which __init__ refuses
        raise TypeError("expected msgpack bytes from redis, got str")
    obj = msgpack.unpackb(raw, raw=False)
    if not isinstance(obj, dict):
        raise ValueError(f"expected a msgpack map, got {type(obj).__name__}")
    return obj


def _record(raw: bytes | str, key: str) -> PrefixRecord:
    """A stored record, or StoreUnavailable naming the key if it cannot be decoded (a foreign writer, a
    newer or older format): for the caller it is a store that cannot answer for that name."""
    try:
        return PrefixRecord.from_dict(_unpack(raw))
    except Exception as exc:  # msgpack, KeyError, ValueError, TypeError: whatever the bytes were
        raise StoreUnavailable(f"the prefix record at {key!r} cannot be decoded ({type(exc).__name__}: {exc}); "
                               "delete it or fix its writer") from exc


def _pxat(record: PrefixRecord) -> int | None:
    """A lease's end as Redis' absolute expiry (ms), None for a prefix without one."""
    return None if record.expires_at is None else max(1, int(record.expires_at * 1000))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@contextlib.contextmanager
def _unavailable(op: str) -> Iterator[None]:
    """Turn any Redis or socket failure inside the block into StoreUnavailable."""
    try:
        yield
    except _BACKEND_ERRORS as exc:
        raise StoreUnavailable(f"prefix store (redis) unavailable during {op}: {type(exc).__name__}: {exc}") from exc


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


class RedisPrefixStore:
    """`PrefixStore` on Redis. The client is injected (see `connect`) and closed by `aclose()`.

    The client must return bytes (decode_responses=False): values are msgpack.
    """

    def __init__(self, client: Redis, namespace: str = DEFAULT_NAMESPACE) -> None:
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("RedisPrefixStore needs a client with decode_responses=False (values are msgpack)")
        if not namespace:
            raise ValueError("namespace must not be empty")
        self._client = client
        self._ns = namespace
        self._channel = f"{namespace}:events"
        self._fingerprints_key = f"{namespace}:fingerprints"
        self._closed = asyncio.Event()

    def _record_key(self, fingerprint: str, name: str) -> str:
        return f"{self._ns}:prefix:{fingerprint}:{name}"

    def _index_key(self, fingerprint: str) -> str:
        return f"{self._ns}:prefixes:{fingerprint}"

    def _replica_key(self, replica_id: str) -> str:
        return f"{self._ns}:replica:{replica_id}"

    async def _transaction(self, op: str, name: str, keys: tuple[str, ...],
                           attempt: Callable[[Pipeline], Awaitable[T]]) -> T:
        """`attempt(pipe)` with `keys` watched (it reads, then MULTI / writes / EXEC), retried on WatchError: the
        compare-and-set of every write here."""
        with _unavailable(op):
            async with self._client.pipeline(transaction=True) as pipe:
                for _ in range(_TX_ATTEMPTS):
                    try:
                        await pipe.watch(*keys)
                        return await attempt(pipe)
                    except WatchError:  # another client wrote a watched key between WATCH and EXEC
                        continue
        raise StoreUnavailable(f"{op} of prefix {name!r} lost {_TX_ATTEMPTS} races in a row; retry")

    def _stored(self, record: PrefixRecord, origin: str) -> tuple[str, bytes, bytes]:
        """A record's key, its value, and the announcement of its writing."""
        return (self._record_key(record.fingerprint, record.key), _pack(record.to_dict()),
                _pack(PrefixEvent("registered", record.fingerprint, record.key, origin).to_dict()))

    async def put(self, record: PrefixRecord, origin: str) -> tuple[PrefixRecord, bool]:
        key, payload, announcement = self._stored(record, origin)

        async def attempt(pipe: Pipeline) -> tuple[PrefixRecord, bool]:
            raw = await pipe.get(key)
            if raw is not None:
                existing = _record(raw, key)
                if existing.same_content(record):
                    return existing, False
                raise PrefixConflict(existing)
            pipe.multi()
            pipe.set(key, payload, pxat=_pxat(record))
            pipe.sadd(self._index_key(record.fingerprint), record.key)
            pipe.sadd(self._fingerprints_key, record.fingerprint)
            pipe.publish(self._channel, announcement)
            await pipe.execute()
            return PrefixRecord.from_dict(record.to_dict()), True
        return await self._transaction("put", record.name, (key,), attempt)

    async def update(self, record: PrefixRecord, origin: str) -> bool:
        key, payload, announcement = self._stored(record, origin)

        async def attempt(pipe: Pipeline) -> bool:
            if not await pipe.exists(key):
                return False
            pipe.multi()
            pipe.set(key, payload, pxat=_pxat(record))
            pipe.publish(self._channel, announcement)
            await pipe.execute()
            return True
        return await self._transaction("update", record.name, (key,), attempt)

    async def get(self, fingerprint: str, name: str) -> PrefixRecord | None:
        key = self._record_key(fingerprint, name)
        with _unavailable("get"):
            raw = await self._client.get(key)
        return None if raw is None else _record(raw, key)

    async def list(self, fingerprint: str | None = None) -> builtins.list[PrefixRecord]:
        records: builtins.list[PrefixRecord] = []
        with _unavailable("list"):
            if fingerprint is None:
                fingerprints = sorted(_text(f) for f in await self._client.smembers(self._fingerprints_key))
            else:
                fingerprints = [fingerprint]
            for fp in fingerprints:
                names = sorted(_text(n) for n in await self._client.smembers(self._index_key(fp)))
                if not names:
                    continue
                keys = [self._record_key(fp, n) for n in names]
                raws = await self._client.mget(keys)
                for key, raw in zip(keys, raws):
                    if raw is None:        # deleted between SMEMBERS and MGET
                        continue
                    try:
                        records.append(_record(raw, key))
                    except StoreUnavailable as exc:     # one bad record must not hide the others
                        logger.error("%s; listing the others", exc)
        return records

    async def delete(self, fingerprint: str, name: str, origin: str) -> bool:
        key, index = self._record_key(fingerprint, name), self._index_key(fingerprint)
        announcement = _pack(PrefixEvent("deleted", fingerprint, name, origin).to_dict())

        async def attempt(pipe: Pipeline) -> bool:
            if not await pipe.exists(key):
                if await pipe.sismember(index, name):       # its lease expired: tidy the index
                    pipe.multi()
                    pipe.srem(index, name)
                    await pipe.execute()
                return False
            others = await pipe.scard(index) - int(await pipe.sismember(index, name))
            pipe.multi()
            pipe.delete(key)
            pipe.srem(index, name)
            if others == 0:
                pipe.srem(self._fingerprints_key, fingerprint)
            pipe.publish(self._channel, announcement)
            await pipe.execute()
            return True
        # The index is watched too: whether the fingerprint set keeps fp depends on it.
        return await self._transaction("delete", name, (key, index), attempt)

    async def heartbeat(self, info: ReplicaInfo, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        stamped = ReplicaInfo.from_dict(info.to_dict())
        stamped.updated_at = time.time()
        with _unavailable("heartbeat"):
            await self._client.set(
                self._replica_key(info.replica_id), _pack(stamped.to_dict()), px=max(1, round(ttl_s * 1000))
            )

    async def replicas(self, fingerprint: str | None = None) -> builtins.list[ReplicaInfo]:
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self._replica_key("")) + "*"
        with _unavailable("replicas"):
            keys = [k async for k in self._client.scan_iter(match=pattern, count=500)]
            raws = await self._client.mget(keys) if keys else []
        infos = [ReplicaInfo.from_dict(_unpack(r)) for r in raws if r is not None]  # None: expired since SCAN
        return sorted(
            (i for i in infos if fingerprint is None or i.fingerprint == fingerprint), key=lambda i: i.replica_id
        )

    async def events(self) -> AsyncGenerator[PrefixEvent, None]:
        """Announcements, with a `resync` each time the subscription is (re)established.

        A `subscribe` confirmation from Redis is what triggers `resync`: it arrives for our own
        SUBSCRIBE and also when redis-py silently reconnects and resubscribes inside `get_message`,
        so no outage goes unannounced. Backend errors are logged, never raised: the loop resubscribes
        with exponential backoff until Redis is back or the store is closed.
        """
        backoff, failing = _BACKOFF_MIN_S, False
        while not self._closed.is_set():
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                while not self._closed.is_set():
                    message = await pubsub.get_message(timeout=_POLL_S)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        if failing:
                            logger.info("prefix events: resubscribed to %s", self._channel)
                        backoff, failing = _BACKOFF_MIN_S, False
                        yield PrefixEvent.resync()
                    elif message["type"] == "message":
                        event = _decode_event(message["data"])
                        if event is not None:
                            yield event
            except _BACKEND_ERRORS as exc:
                if not self._closed.is_set() and not failing:
                    logger.warning(
                        "prefix events: lost %s (%s: %s); resubscribing", self._channel, type(exc).__name__, exc
                    )
                failing = True
            finally:
                with contextlib.suppress(*_BACKEND_ERRORS):
                    await pubsub.aclose()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def ping(self) -> bool:
        try:
            return bool(await self._client.ping())
        except _BACKEND_ERRORS:
            return False

    async def aclose(self) -> None:
        self._closed.set()
        await self._client.aclose()


def _decode_event(data: bytes) -> PrefixEvent | None:
    try:
        return PrefixEvent.from_dict(_unpack(data))
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        logger.warning("prefix events: ignoring a malformed announcement (%s: %s)", type(exc).__name__, exc)
        return None


async def connect(url: str, namespace: str = DEFAULT_NAMESPACE) -> RedisPrefixStore:
    """Build a client for `url` (redis://[:password@]host:port/db) and check that Redis answers.

    Short socket timeouts keep a dead Redis from stalling registry calls (they raise
    StoreUnavailable within ~2 s); one quick retry lets a pooled connection that a Redis restart
    broke be replaced transparently. Raises StoreUnavailable when Redis does not answer PING.
    """
    client = Redis.from_url(
        url,
        socket_timeout=2.0,
        socket_connect_timeout=2.0,
        health_check_interval=10,
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=1),
    )
    store = RedisPrefixStore(client, namespace)
    if not await store.ping():
        await store.aclose()
        raise StoreUnavailable(f"prefix store: redis at {_redact(url)} does not answer PING")
    return store
