"""vLLM-format KV events: the encoding against vLLM's own msgspec structs, the record queue's bounds,
and a real engine publishing over real ZMQ sockets on loopback, decoded live and by replay."""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from engine.config import EngineConfig
from engine.kv.block_pool import hash_block, root_hash
from engine.kv.event_publisher import ZmqEventPublisher
from engine.kv.events import KVEventQueue, KVEventsConfig, encode_batch, events_of, external_hash
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams
from tests.helpers.kv_subscriber import (
    LOOPBACK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    Subscriber,
    flatten,
    listening,
)
from tests.helpers.redis_server import free_port


def test_encoding_is_byte_identical_to_vllms_msgspec_structs() -> None:
    h0 = hash_block(root_hash("m"), [1, 2])
    h1 = hash_block(h0, [3, 4])
    h2 = hash_block(h1, [5, 6])
    records = [("stored", h0, None, (1, 2)), ("stored", h1, h0, (3, 4)), ("removed", h2), ("removed", h1),
               ("cleared",), ("stored", h2, h1, (5, 6))]
    ours = encode_batch(events_of(records, block_size=2), ts=1757500000.25)
    x = external_hash
    theirs = msgspec.msgpack.encode(KVEventBatch(ts=1757500000.25, data_parallel_rank=0, events=[
        BlockStored(block_hashes=[x(h0), x(h1)], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                    lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[x(h2), x(h1)], medium="GPU"),
        AllBlocksCleared(),
        BlockStored(block_hashes=[x(h2)], parent_block_hash=x(h1), token_ids=[5, 6], block_size=2, lora_id=None,
                    medium="GPU", lora_name=None)]))
    assert ours == theirs
    assert x(h0) == int.from_bytes(h0[-8:], "big") and 0 <= x(h0) < 2**64


def test_queue_drops_oldest_counts_and_fences_with_a_clear() -> None:
    q = KVEventQueue(capacity=3)
    for i in range(5):
        q.removed(bytes([i]) * 32)  # type: ignore[arg-type]
    assert q.dropped == 2
    assert q.drain() == [("cleared",)] + [("removed", bytes([i]) * 32) for i in (2, 3, 4)]
    q.removed(b"\x09" * 32)  # type: ignore[arg-type]
    assert q.drain() == [("removed", b"\x09" * 32)] and q.drain() == []


def test_config_is_vllms_json() -> None:
    c = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                                 '"replay_endpoint": "tcp://*:5558", "topic": "kv", "buffer_steps": 10, '
                                 '"hwm": 5, "max_queue_size": 7}')
    assert c.enabled and c.topic == "kv" and c.replay_endpoint == "tcp://*:5558" and c.max_queue_size == 7
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').enabled
    for bad, msg in [('{"enable": true}', "unknown field"), ('{"hwm": "1"}', "hwm must be int"),
                     ('{"publisher": "kafka"}', "publisher must be"), ('{"endpoint": "http://x"}', "endpoint must"),
                     ('{"buffer_steps": 0}', "buffer_steps"), ("[]", "JSON object"), ("{", "not valid JSON")]:
        with pytest.raises(ValueError, match=msg):
            KVEventsConfig.from_json(bad)


def _run(engine: LLMEngine, rid: str, prompt: list[int]) -> None:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def test_engine_publishes_stores_evictions_and_reset_and_replays_what_a_late_subscriber_missed(
        tiny_llama_dir: Path) -> None:
    pub, rep = free_port(), free_port()
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{pub}", replay_endpoint=f"tcp://*:{rep}",
                         topic="kv")
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=16, num_kv_blocks=6, max_model_len=96,
                                    kv_events_config=json.dumps(dataclasses.asdict(cfg))))
    p1 = [(7 * i) % 300 + 3 for i in range(40)]
    p2 = [(11 * i) % 300 + 5 for i in range(70)]
    sub = None
    try:
        _run(engine, "a", p1)                      # blocks 0, 1 hashed (2 full blocks of 40 tokens)
        time.sleep(0.1)                            # published before anyone listens
        sub = Subscriber(f"tcp://127.0.0.1:{pub}", topic="kv")
        time.sleep(0.3)                            # the subscription reaches the PUB socket
        _run(engine, "b", p2)                      # 5 blocks: evicts block 1 (LRU order), hashes 4 new ones
        assert engine.core.reset_prefix_cache() == 5    # nothing running or pinned: everything goes
        live = sub.wait_for(lambda got: any(isinstance(e, AllBlocksCleared) for m in got for e in m.batch.events))
        assert live[0].seq > 0                     # the first batch was missed...
        missed = sub.replay(f"tcp://127.0.0.1:{rep}", start=0)
        assert [m.seq for m in missed] == list(range(len(missed)))
        assert [m.payload for m in missed[live[0].seq:]] == [m.payload for m in live]   # replay == live bytes
        stream = missed[:live[0].seq] + live       # ...and replay fills the gap
        assert [m.seq for m in stream] == list(range(len(stream)))
        a = [external_hash(h) for h in engine.core.manager.block_hashes(p1)]
        b = [external_hash(h) for h in engine.core.manager.block_hashes(p2)]
        assert flatten(stream) == [
            ("stored", a[0], None, tuple(p1[:16])), ("stored", a[1], a[0], tuple(p1[16:32])),
            ("removed", a[1]),
            *[("stored", b[i], b[i - 1] if i else None, tuple(p2[16 * i:16 * (i + 1)])) for i in range(4)],
            ("cleared",)]
        for m in stream:
            assert m.batch.data_parallel_rank == 0 and m.batch.ts > 0
            for ev in m.batch.events:
                if isinstance(ev, BlockStored):
                    assert ev.block_size == 16 and ev.medium == "GPU" and ev.lora_name is None
        assert [m.seq for m in sub.replay(f"tcp://127.0.0.1:{rep}", start=live[-1].seq)] == [live[-1].seq]
    finally:
        if sub is not None:
            sub.close()
        engine.core.close()


def test_a_subscriber_that_never_reads_never_blocks_the_publisher() -> None:
    port = free_port()
    q = KVEventQueue(capacity=100_000)
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}", hwm=1),
                                  q, block_size=16, interval=0.001).start()
    ctx = zmq.Context()
    stuck = ctx.socket(zmq.SUB)                    # subscribes, then never calls recv
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.connect(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.2)
        for i in range(3000):
            q.removed(i.to_bytes(32, "big"))  # type: ignore[arg-type]
            if i % 10 == 0:
                time.sleep(0.0005)             # let batches form
        deadline = time.monotonic() + 20
        while len(q):                          # until the publisher has drained everything
            assert time.monotonic() < deadline, "the publisher stopped draining"
            time.sleep(0.01)
        assert publisher.published_batches > 10 and q.dropped == 0
    finally:
        publisher.close()
        stuck.close()
        ctx.term()


def test_a_port_in_use_is_a_clear_error() -> None:
    port = free_port()
    first = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"),
                              KVEventQueue(10), block_size=16).start()
    try:
        with pytest.raises(RuntimeError, match=f"cannot open tcp://\\*:{port}"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"),
                              KVEventQueue(10), block_size=16).start()
    finally:
        first.close()


def test_the_default_endpoint_and_the_readmes_example_bind_loopback_only() -> None:
    """Issue 24, item 5: the documented configuration bound tcp://*:5557 (and the replay socket) on every
    interface: anyone who could reach the host read every prompt's token ids."""
    default = KVEventsConfig(enable_kv_cache_events=True)
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    example = json.loads(readme.split("--kv-events-config '", 1)[1].split("'", 1)[0].replace("\n", " "))
    assert example["endpoint"] == "tcp://127.0.0.1:5557" and example["replay_endpoint"] == "tcp://127.0.0.1:5558"
    pub, rep = free_port(), free_port()
    host = default.endpoint.rsplit(":", 1)[0]
    publisher = ZmqEventPublisher(dataclasses.replace(default, endpoint=f"{host}:{pub}",
                                                      replay_endpoint=f"{host}:{rep}"),
                                  KVEventQueue(10), block_size=16).start()
    try:
        assert listening(pub) and listening(pub) <= LOOPBACK, listening(pub)    # bound, loopback only
        assert listening(rep) and listening(rep) <= LOOPBACK, listening(rep)
    finally:
        publisher.close()


def test_with_curve_only_admitted_subscribers_get_events() -> None:
    """The shared-secret option: CURVE with a server key pair and the subscribers' public keys listed. A plain
    subscriber, and a CURVE one whose key is not listed, get nothing, neither live nor by replay."""
    server_public, server_secret = zmq.curve_keypair()
    admitted, stranger = zmq.curve_keypair(), zmq.curve_keypair()
    cfg = EngineConfig(kv_events_config=json.dumps({"enable_kv_cache_events": True}),
                       kv_events_secret_key=server_secret.decode(), kv_events_client_keys=(admitted[0].decode(),))
    curve = cfg.kv_events_curve()
    assert curve is not None and curve.public_key == server_public.decode()
    assert server_secret.decode() not in repr(cfg) + repr(curve)
    pub, rep = free_port(), free_port()
    q = KVEventQueue(100)
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{pub}",
                                                 replay_endpoint=f"tcp://127.0.0.1:{rep}"),
                                  q, block_size=16, curve=curve).start()
    subs = {"plain": Subscriber(f"tcp://127.0.0.1:{pub}"),
            "stranger": Subscriber(f"tcp://127.0.0.1:{pub}", server_key=curve.public_key, client=stranger),
            "admitted": Subscriber(f"tcp://127.0.0.1:{pub}", server_key=curve.public_key, client=admitted)}
    try:
        time.sleep(0.5)                              # handshakes (and refusals) done
        for i in range(3):
            q.removed(i.to_bytes(32, "big"))  # type: ignore[arg-type]
            time.sleep(0.05)
        subs["admitted"].wait_for(lambda got: len(flatten(got)) == 3)
        assert subs["plain"].poll(0.5) == [] and subs["stranger"].poll(0.2) == []
        assert len(flatten(subs["admitted"].replay(f"tcp://127.0.0.1:{rep}", start=0))) == 3
        for name in ("plain", "stranger"):
            with pytest.raises(AssertionError, match="replay timed out"):
                subs[name].replay(f"tcp://127.0.0.1:{rep}", start=0, timeout=0.5)
    finally:
        publisher.close()
        for s in subs.values():
            s.close()
    for bad in [dict(kv_events_secret_key="," * 40), dict(kv_events_secret_key=server_secret.decode()[:39]),
                dict(kv_events_secret_key=server_secret.decode(), kv_events_client_keys=("nope",))]:
        with pytest.raises(ValueError, match="40 characters of Z85"):
            EngineConfig(kv_events_config='{"enable_kv_cache_events": true}', **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="need KV events on"):
        EngineConfig(kv_events_secret_key=server_secret.decode())
