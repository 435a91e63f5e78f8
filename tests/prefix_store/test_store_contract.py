"""The PrefixStore contract, run against every backend (`stores` is parametrized: memory, redis).

`a` and `b` are two clients of one registry, as two replicas would hold them.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from prefix_store import PrefixConflict, PrefixEvent, PrefixRecord, PrefixStore, ReplicaInfo

FP = "a1" * 16
OTHER_FP = "b2" * 16
Stores = tuple[PrefixStore, PrefixStore]


async def next_event(events: AsyncIterator[PrefixEvent], timeout_s: float = 5.0) -> PrefixEvent:
    return await asyncio.wait_for(anext(events), timeout_s)


async def test_put_get_list_delete(stores: Stores, make_record: Any) -> None:
    a, b = stores
    rec = make_record("sys", [10, 11, 12])
    stored, created = await a.put(rec, origin="ra")
    assert created and stored == rec
    assert await b.get(FP, "sys") == rec
    assert await b.get(FP, "missing") is None
    assert await b.list(FP) == [rec]
    assert await b.delete(FP, "sys", origin="rb") is True
    assert await a.get(FP, "sys") is None
    assert await a.list(FP) == [] and await a.list() == []
    assert await a.delete(FP, "sys", origin="ra") is False


async def test_list_is_sorted_by_fingerprint_then_name(stores: Stores, make_record: Any) -> None:
    a, _ = stores
    for name, fp in [("zeta", FP), ("alpha", OTHER_FP), ("beta", FP), ("émoji ✓", FP)]:
        await a.put(make_record(name, fingerprint=fp), origin="ra")
    assert [(r.fingerprint, r.name) for r in await a.list()] == [
        (FP, "beta"), (FP, "zeta"), (FP, "émoji ✓"), (OTHER_FP, "alpha")
    ]


async def test_identical_put_is_idempotent_and_keeps_first_metadata(stores: Stores, make_record: Any) -> None:
    a, b = stores
    first = make_record("sys", [1, 2, 3], description="first", created_at=100.0)
    await a.put(first, origin="ra")
    again = make_record("sys", [1, 2, 3], description="second", created_at=200.0)
    stored, created = await b.put(again, origin="rb")
    assert not created
    assert stored == first  # the stored record wins, not the new metadata
    assert await a.list(FP) == [first]


async def test_different_content_conflicts_and_leaves_the_record(stores: Stores, make_record: Any) -> None:
    a, b = stores
    first = make_record("sys", [1, 2, 3])
    await a.put(first, origin="ra")
    with pytest.raises(PrefixConflict) as info:
        await b.put(make_record("sys", [1, 2, 4]), origin="rb")
    assert info.value.existing == first
    assert "sys" in str(info.value)
    assert await a.get(FP, "sys") == first


async def test_concurrent_conflicting_puts_have_exactly_one_winner(stores: Stores, make_record: Any) -> None:
    a, b = stores
    for i in range(40):
        name = f"race-{i}"
        rec_a, rec_b = make_record(name, [1, i]), make_record(name, [2, i])
        results = await asyncio.gather(a.put(rec_a, "ra"), b.put(rec_b, "rb"), return_exceptions=True)
        winners = [r for r in results if isinstance(r, tuple)]
        losers = [r for r in results if isinstance(r, PrefixConflict)]
        assert len(winners) == 1 and len(losers) == 1, results
        winner, created = winners[0]
        assert created
        assert losers[0].existing == winner
        assert await a.get(FP, name) == winner == await b.get(FP, name)
    assert len(await a.list(FP)) == 40


async def test_concurrent_identical_puts_create_once(stores: Stores, make_record: Any) -> None:
    a, b = stores
    for i in range(40):
        rec = make_record(f"same-{i}", [7, i])
        results = await asyncio.gather(a.put(rec, "ra"), b.put(rec, "rb"), a.put(rec, "ra"))
        assert sorted(created for _, created in results) == [False, False, True]
        assert all(stored == rec for stored, _ in results)


async def test_fingerprints_namespace_records(stores: Stores, make_record: Any) -> None:
    a, b = stores
    mine, theirs = make_record("sys", [1, 2], fingerprint=FP), make_record("sys", [9, 9, 9], fingerprint=OTHER_FP)
    assert (await a.put(mine, "ra"))[1]
    assert (await b.put(theirs, "rb"))[1]  # same name, other model: no conflict
    assert await a.list(FP) == [mine]
    assert await a.list(OTHER_FP) == [theirs]
    assert await a.list(None) == [mine, theirs]
    assert await a.get(OTHER_FP, "sys") == theirs
    assert await a.delete(FP, "sys", "ra")
    assert await b.list(None) == [theirs]
    assert await b.list(FP) == []


async def test_events_reach_other_clients_and_the_origin(stores: Stores, make_record: Any) -> None:
    a, b = stores
    async with contextlib.aclosing(b.events()) as b_events, contextlib.aclosing(a.events()) as a_events:
        # The first item says the subscription is live: nothing after it can be missed.
        assert (await next_event(b_events)).kind == "resync"
        assert (await next_event(a_events)).kind == "resync"

        await a.put(make_record("sys"), origin="ra")
        registered = PrefixEvent("registered", FP, "sys", "ra")
        assert await next_event(b_events) == registered
        assert await next_event(a_events) == registered  # own announcements come back too

        # No-ops announce nothing: an identical put, a conflicting put, deleting a missing name.
        await b.put(make_record("sys"), origin="rb")
        with pytest.raises(PrefixConflict):
            await b.put(make_record("sys", [9]), origin="rb")
        assert not await b.delete(FP, "nope", origin="rb")

        assert await b.delete(FP, "sys", origin="rb")
        deleted = PrefixEvent("deleted", FP, "sys", "rb")
        assert await next_event(b_events) == deleted
        assert await next_event(a_events) == deleted


async def test_aclose_ends_event_streams(stores: Stores) -> None:
    a, _ = stores
    events = a.events()
    assert (await next_event(events)).kind == "resync"
    await a.aclose()
    with pytest.raises(StopAsyncIteration):
        await next_event(events, timeout_s=3.0)


async def test_heartbeats_expire_after_their_ttl(stores: Stores) -> None:
    a, b = stores
    short = ReplicaInfo("r-short", "10.0.0.1:8000", pinned=["sys"], load={"running": 3, "waiting": 1}, fingerprint=FP)
    long = ReplicaInfo("r-long", "10.0.0.2:8000", fingerprint=OTHER_FP, updated_at=0.0)
    before = time.time()
    await a.heartbeat(short, ttl_s=0.5)
    await b.heartbeat(long, ttl_s=30)
    seen = await a.replicas()
    assert [r.replica_id for r in seen] == ["r-long", "r-short"]
    assert seen[1].pinned == ["sys"] and seen[1].load == {"running": 3, "waiting": 1}
    assert seen[1].address == "10.0.0.1:8000" and seen[1].fingerprint == FP
    assert all(r.updated_at >= before for r in seen)  # stamped by heartbeat()
    assert [r.replica_id for r in await a.replicas(FP)] == ["r-short"]

    await asyncio.sleep(0.65)
    assert [r.replica_id for r in await b.replicas()] == ["r-long"]
    assert await b.replicas(FP) == []

    await a.heartbeat(short, ttl_s=0.5)  # a replica that comes back shows up again
    assert [r.replica_id for r in await b.replicas(FP)] == ["r-short"]
    with pytest.raises(ValueError):
        await a.heartbeat(short, ttl_s=0)


async def test_records_with_messages_round_trip(stores: Stores, make_record: Any) -> None:
    a, b = stores
    source = {
        "messages": [
            {"role": "system", "content": "Tu es un assistant précis. 你好 🙂"},
            {"role": "user", "content": [{"type": "text", "text": "example"}]},
            {"role": "assistant", "content": "ok", "tool_calls": None},
        ]
    }
    rec = make_record("chat", list(range(300)), source=source, description=None, created_at=1234.5)
    await a.put(rec, origin="ra")
    got = await b.get(FP, "chat")
    assert got == rec
    assert got is not None and got.source == source and isinstance(got.created_at, float)


async def test_records_are_values(stores: Stores, make_record: Any) -> None:
    a, _ = stores
    rec = make_record("sys", [1, 2, 3])
    stored, _ = await a.put(rec, origin="ra")
    rec.token_ids.append(99)
    stored.token_ids.append(98)
    got = await a.get(FP, "sys")
    assert got is not None and got.token_ids == [1, 2, 3]
    got.source["prompt"] = "changed"
    assert (await a.list())[0].source == {"prompt": "prompt of sys"}


async def test_ping(stores: Stores) -> None:
    a, b = stores
    assert await a.ping() and await b.ping()


def test_records_survive_to_dict_from_dict(make_record: Any) -> None:
    rec = make_record("sys", source={"token_ids": [1, 2]}, description="d")
    assert PrefixRecord.from_dict(rec.to_dict()) == rec
    assert PrefixRecord.from_dict({**rec.to_dict(), "added_later": 1}) == rec  # unknown keys ignored
    for kind in ("named", "cache_key", "cache_control"):     # a breakpoint's lease stays one on another replica
        lease = make_record("cc-1", [1, 2], kind=kind)
        assert PrefixRecord.from_dict(lease.to_dict()).kind == kind
    info = ReplicaInfo("r", "h:1", ["sys"], {"running": 1}, FP, 5.0)
    assert ReplicaInfo.from_dict(info.to_dict()) == info


def test_same_content_compares_tokens_and_fingerprint(make_record: Any) -> None:
    rec = make_record("sys", [1, 2])
    assert rec.same_content(make_record("other-name", [1, 2], description="x"))
    assert not rec.same_content(make_record("sys", [1, 2, 3]))
    assert not rec.same_content(make_record("sys", [1, 2], fingerprint=OTHER_FP))


@pytest.mark.parametrize(
    "bad",
    [{"name": ""}, {"fingerprint": ""}, {"source": {"text": "no known key"}}],
)
def test_invalid_records_are_refused(bad: dict[str, Any]) -> None:
    fields: dict[str, Any] = {"name": "sys", "fingerprint": FP, "token_ids": [1], "source": {"prompt": "p"}}
    with pytest.raises(ValueError):
        PrefixRecord(**{**fields, **bad})


def test_only_registered_and_deleted_travel_on_the_wire() -> None:
    assert PrefixEvent.from_dict(PrefixEvent("deleted", FP, "n", "r").to_dict()) == PrefixEvent("deleted", FP, "n", "r")
    with pytest.raises(ValueError):
        PrefixEvent.from_dict(PrefixEvent.resync().to_dict())


async def test_a_leases_salt_and_hidden_head_round_trip(stores: Stores, make_record: Any) -> None:
    """Issue 34, item 2: a lease on a published prefix keeps the request's two-part salt (so every replica pins the
    blocks its requests hit) and how many leading tokens its owner may not read; a one-part salt is written as the
    plain string older replicas read."""
    a, b = stores
    lease = make_record("pck-1", list(range(64)), owner="t", salt=((0, "published:sys"), (2, "tenant:t")),
                        hidden_tokens=40)
    named = make_record("named", list(range(32)), owner="t", salt=((0, "tenant:t"),))
    for rec in (lease, named):
        await a.put(rec, origin="ra")
        got = await b.get(FP, rec.key)
        assert got == rec and got is not None and got.salt == rec.salt and got.hidden_tokens == rec.hidden_tokens
    assert named.to_dict()["salt"] == "tenant:t" and lease.to_dict()["salt"] == [[0, "published:sys"], [2, "tenant:t"]]
    assert PrefixRecord.from_dict({**named.to_dict(), "salt": None, "hidden_tokens": None}).salt == ()
