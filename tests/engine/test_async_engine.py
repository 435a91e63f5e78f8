"""AsyncEngine: streaming, aborts, failed steps, thread ownership of the core, cancellation of pins."""
from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import AsyncEngine, EngineConfig, InvalidRequest, PinCapExceeded, SamplingParams
from engine.errors import EngineError
from engine.kv.block_manager import BlockManager
from engine.kv.block_pool import BlockPool
from engine.outputs import RequestOutput
from engine.sched.scheduler import Scheduler


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def watch_threads(obj: Any, seen: set[str]) -> None:
    """Re-classes `obj` so that every method and property it has records the name of the calling thread."""
    cls = type(obj)

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*args: Any, **kwargs: Any) -> Any:
            seen.add(threading.current_thread().name)
            return fn(*args, **kwargs)
        return inner

    members: dict[str, Any] = {}
    for name, member in vars(cls).items():
        if name.startswith("__"):
            continue
        if isinstance(member, property) and member.fget is not None:
            members[name] = property(wrap(member.fget))
        elif callable(member):
            members[name] = wrap(member)
    obj.__class__ = type(f"Watched{cls.__name__}", (cls,), members)


def pool_invariants(pool: BlockPool) -> None:
    queued = set(pool.free_queue.ids())
    for b in pool.blocks:
        assert (b.block_id in queued) == (b.ref_count == 0 and b.pin_count == 0), b
    assert pool.num_pinned == sum(1 for b in pool.blocks if b.pin_count > 0)
    assert pool.free_queue.size == len(queued)


async def test_the_core_is_touched_only_on_the_engine_thread(tiny_llama_dir: Path) -> None:
    """Many concurrent requests and registrations on a tiny cache: every read or write of the pool, the
    block manager and the scheduler happens on the engine thread, and the pool's invariants hold after
    every step. (Before the upper half was reshaped, `generate` ran the cache-dependent checks on the
    event loop, racing the engine thread.)"""
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=48, max_model_len=128))
    seen: set[str] = set()
    core = eng._core
    for obj in (core.pool, core.manager, core.scheduler):
        assert isinstance(obj, (BlockPool, BlockManager, Scheduler))
        watch_threads(obj, seen)
    step = core.step
    steps = {"n": 0}

    def checked_step():  # type: ignore[no-untyped-def]
        out = step()
        pool_invariants(core.pool)
        steps["n"] += 1
        return out

    core.step = checked_step  # type: ignore[method-assign]
    await eng.start()
    try:
        async def one(i: int) -> int:
            n = 0
            try:
                params = SamplingParams(max_tokens=4 + i % 9, ignore_eos=True)
                async for out in eng.generate(toks(5 + i % 17, i), params):
                    n += len(out.outputs[0].token_ids)
            except EngineError:
                return -1
            return n

        async def pin_cycle(i: int) -> None:
            prefix = toks(16, 1000 + i % 3)            # three prefixes, pinned and unpinned concurrently
            try:
                await eng.pin_prefix(prefix)
            except PinCapExceeded:
                return
            await asyncio.sleep(0.001 * i)
            assert await eng.unpin_prefix(prefix) == 4

        results = await asyncio.gather(*(one(i) for i in range(40)), *(pin_cycle(i) for i in range(12)))
        assert [r for r in results[:40] if r != -1] == [4 + i % 9 for i in range(40) if results[i] != -1]
        assert sum(r == -1 for r in results[:40]) == 0
        for _ in range(200):
            if eng.stats().requests_running == eng.stats().requests_waiting == 0:
                break
            await asyncio.sleep(0.01)
        assert eng.stats().kv_blocks_used == eng.stats().kv_blocks_pinned == 0
    finally:
        await eng.shutdown()
    assert steps["n"] > 10
    assert seen and all(name.startswith("engine-step") for name in seen), seen


async def test_pin_cancelled_at_any_point_leaves_nothing_pinned(tiny_llama_dir: Path) -> None:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=128))
    await eng.start()
    try:
        kept = cancelled = 0
        for k in range(36):
            prefix = toks(40, k % 5)                         # some already cached (pinned at once), some computed
            task = asyncio.create_task(eng.pin_prefix(prefix))
            if k % 6 == 5:
                await asyncio.wait({task})                   # no cancel: it must finish, pinned
            else:
                for _ in range(k % 6):                       # cancel at a different point each time
                    await asyncio.sleep(0 if k < 18 else 0.002)
                task.cancel()
            try:
                pinned = await task
            except asyncio.CancelledError:
                cancelled += 1
                continue
            kept += 1                                        # it finished before the cancel: ours to undo
            assert pinned.num_pinned_blocks == 10
            assert await eng.unpin_prefix(prefix) == 10
        for _ in range(200):
            await eng.unpin_prefix([1])                      # a no-op command: forces a step and fresh stats
            if eng.stats().kv_blocks_pinned == 0:
                break
            await asyncio.sleep(0.01)
        assert eng.stats().kv_blocks_pinned == 0 and eng.stats().kv_blocks_used == 0
        assert eng._engine.pins.jobs == {}
        assert kept >= 6 and cancelled >= 6                  # k % 6 == 5 always kept; k % 6 == 0 always cancelled
    finally:
        await eng.shutdown()


def test_abort_before_fork_finishes_the_request(tiny_llama_dir: Path) -> None:
    from engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=64))
    group = engine.add_request("b", toks(9, 1), SamplingParams(n=1, best_of=2, max_tokens=5))
    out = engine.abort("b")
    assert group.finished and out is not None and out.finished
    assert not engine.has_unfinished() and engine.stats().kv_blocks_used == 0


async def test_cache_dependent_refusals_arrive_through_the_stream(tiny_llama_dir: Path) -> None:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=20, pinned_fraction=0.6))
    await eng.start()
    try:
        await eng.pin_prefix(toks(48, 7))                    # 12 of 20 blocks pinned
        stream = eng.add(toks(30, 8), SamplingParams(max_tokens=10))   # 10 blocks: fits the cache, not beside the pins
        with pytest.raises(InvalidRequest, match="pinned"):
            await stream.accepted()
        with pytest.raises(InvalidRequest):                  # fixed-input checks: at once, on the caller's side
            eng.add(toks(30, 8), SamplingParams(max_tokens=100))
    finally:
        await eng.shutdown()
async def test_async_engine_streams_and_aborts_within_a_step(tiny_llama_dir: Path) -> None:
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=128))
    await eng.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        deltas, ids = [], []
        async for out in eng.generate(toks(9, 1), params):
            deltas.append(out.outputs[0].text)
            ids += out.outputs[0].token_ids
        assert len(ids) == 10 and "".join(deltas) == eng.tokenizer.decode(ids, skip_special_tokens=True)
        assert out.finished and out.outputs[0].finish_reason == "length"

        agen = eng.generate(toks(9, 2), SamplingParams(max_tokens=500, ignore_eos=True))
        async for _ in agen:
            break
        await agen.aclose()
        for _ in range(50):
            if eng.stats().kv_blocks_used == 0:
                break
            await asyncio.sleep(0.01)
        assert eng.stats().kv_blocks_used == 0 and eng.stats().requests_running == 0

        with pytest.raises(InvalidRequest):
            async for _ in eng.generate([], params):
                pass
        # many at once, all finish
        async def one(i: int) -> int:
            n = 0
            async for o in eng.generate(toks(5 + i, i), SamplingParams(max_tokens=5 + i, ignore_eos=True)):
                n += len(o.outputs[0].token_ids)
            return n
        assert await asyncio.gather(*(one(i) for i in range(8))) == [5 + i for i in range(8)]
    finally:
        await eng.shutdown()


async def test_a_failed_step_fails_its_requests_not_the_engine(tiny_llama_dir: Path) -> None:
    from engine.errors import EngineError

    eng = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=128))
    await eng.start()
    real = eng._core.runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):  # fault injection: the third forward pass raises
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device fault")
        return real(*args, **kwargs)

    eng._core.runner.execute = flaky  # type: ignore[method-assign]
    try:
        with pytest.raises(EngineError, match="injected device fault"):
            async for _ in eng.generate(toks(6, 1), SamplingParams(max_tokens=20, ignore_eos=True)):
                pass
        assert eng.is_running
        n = 0
        async for out in eng.generate(toks(6, 2), SamplingParams(max_tokens=5, ignore_eos=True)):
            n += len(out.outputs[0].token_ids)
        assert n == 5
        assert eng.stats().kv_blocks_used == 0
    finally:
        await eng.shutdown()


async def test_a_request_squeezed_out_by_pins_fails_with_a_capacity_error_after_its_output(
        tiny_llama_dir: Path) -> None:
    """Admitted while it fit, then pins took the room: the request keeps what it streamed and ends with
    CapacityExceeded (HTTP 429), not an internal error."""
    from engine.errors import CapacityExceeded
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=20, pinned_fraction=0.9))
    await eng.start()
    try:
        stream = eng.add(toks(8, 3), SamplingParams(max_tokens=60, ignore_eos=True))      # 17 blocks at most
        got = 0
        while got < 4:                                       # it runs...
            got += sum(len(o.outputs[0].token_ids) for o in await stream.get() if o.outputs)
        await eng.pin_prefix(toks(48, 4))                    # ...then 12 of the 20 blocks are pinned
        with pytest.raises(CapacityExceeded):
            while True:
                got += sum(len(o.outputs[0].token_ids) for o in await stream.get() if o.outputs)
        assert 4 <= got < 60
        st = eng.stats()
        assert st.kv_blocks_used == st.kv_blocks_pinned == 12
    finally:
        await eng.shutdown()


def test_a_failure_in_one_requests_output_stage_fails_only_that_request(tiny_llama_dir: Path) -> None:
    from engine.llm_engine import LLMEngine
    from engine.output.processor import OutputProcessor
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=128))
    real = OutputProcessor._token

    def faulty(self, state, seq):  # type: ignore[no-untyped-def]   # fault injection: one request's detokenizer
        if seq.request_id == "bad" and seq.num_output_tokens == 3:
            raise RuntimeError("injected tokenizer fault")
        return real(self, state, seq)

    OutputProcessor._token = faulty  # type: ignore[method-assign]
    try:
        for rid in ("a", "bad", "b"):
            engine.add_request(rid, toks(6, ord(rid[0])), SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
        done: dict[str, RequestOutput] = {}
        while engine.has_unfinished():
            for out in engine.step():
                prev = done.get(out.request_id)
                done[out.request_id] = out.copy() if prev is None else prev.merge(out)
    finally:
        OutputProcessor._token = real  # type: ignore[method-assign]
    assert done["bad"].finished and done["bad"].error is not None and "injected" in done["bad"].error.message
    assert [len(done[r].outputs[0].token_ids) for r in ("a", "b")] == [8, 8]
    assert done["a"].error is None and done["b"].error is None
    assert engine.stats().kv_blocks_used == 0


async def test_aborting_a_stream_before_it_is_admitted_releases_its_waiter(tiny_llama_dir: Path) -> None:
    """A client that cancels while its request waits for admission (the demo page's Stop before the first
    token): `accepted()` returns instead of waiting forever, and nothing keeps running."""
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=64))
    await eng.start()
    try:
        stream = eng.add(toks(8, 1), SamplingParams(max_tokens=50, ignore_eos=True))
        stream.abort()
        await asyncio.wait_for(stream.accepted(), 5)
        assert await asyncio.wait_for(stream.get(), 5) == []
        for _ in range(100):
            await eng.unpin_prefix([1])                      # a no-op command: a step, fresh stats
            if eng.stats().requests_running == eng.stats().requests_waiting == 0:
                break
        assert eng.stats().kv_blocks_used == 0
    finally:
        await eng.shutdown()


async def test_grammars_compile_off_the_loop_and_the_engine_thread(tiny_model_dir: Path) -> None:
    """A structured request waits for its grammar on the grammar thread: meanwhile other requests are
    admitted and finish; a request aborted before its grammar compiled never reaches the engine; a
    grammar that does not compile is refused through the stream."""
    from engine.sample.structured import StructuredSpec

    eng = AsyncEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))
    await eng.start()
    try:
        grammars = eng._core.grammars
        release = threading.Event()
        real = grammars.compile
        compiled_on: list[str] = []

        def slow_compile(spec: StructuredSpec, cancelled: threading.Event | None = None) -> Any:
            compiled_on.append(threading.current_thread().name)   # (the engine thread never compiles)
            if spec.param == "slow":
                release.wait(30)
            return real(spec, cancelled)

        grammars.compile = slow_compile  # type: ignore[method-assign]
        spec = StructuredSpec("regex", "[ab]{3}", "slow")
        slow = eng.add(toks(5, 1), SamplingParams(max_tokens=8, temperature=0.0, structured=spec))
        plain = await eng.add(toks(5, 2), SamplingParams(max_tokens=3, temperature=0.0)).final()
        assert plain[0].finished and not slow.finished             # the plain one ran while the grammar compiled
        dropped = eng.add(toks(5, 3), SamplingParams(max_tokens=8, temperature=0.0, structured=spec))
        dropped.abort()
        release.set()
        (out,) = await slow.final()
        text = out.outputs[0].text
        assert len(text) == 3 and set(text) <= {"a", "b"}, text
        for _ in range(3):
            await asyncio.sleep(0.05)
        assert eng._core.requests == {} and eng.stats().kv_blocks_used == 0
        assert compiled_on and all(name.startswith("grammar_") for name in compiled_on), compiled_on
        bad = eng.add(toks(5, 4), SamplingParams(max_tokens=4, structured=StructuredSpec("json_schema", "{", "x")))
        with pytest.raises(InvalidRequest):
            await bad.final()
    finally:
        await eng.shutdown()


async def test_a_step_from_idle_waits_for_requests_still_arriving(tiny_llama_dir: Path) -> None:
    """A burst: the first request is added while a second is still being prepared (`arriving`); the step
    waits for it, so both are prefilled in the first step (without the wait, the first runs alone)."""
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=128))
    await eng.start()
    steps: list[set[str]] = []
    inner = eng._engine.step

    def step() -> list[RequestOutput]:
        outs = inner()
        steps.append({o.request_id for o in outs})
        return outs

    eng._engine.step = step  # type: ignore[method-assign]
    try:
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        with eng.arriving():
            first = eng.add(toks(9, 1), params, request_id="first")
            await asyncio.sleep(0.02)                    # the second is still being tokenized
        second = eng.add(toks(9, 2), params, request_id="second")
        await first.final()
        await second.final()
        assert steps[0] == {"first", "second"}, steps
        # nothing arriving: a lone request starts at once, and a request that never comes costs GATHER_S at most
        with eng.arriving():
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await eng.add(toks(9, 3), params, request_id="third").final()
            assert loop.time() - t0 < 5
    finally:
        await eng.shutdown()


async def test_a_failing_command_fails_its_request_not_the_engine(tiny_llama_dir: Path) -> None:
    """Issue 24, item 20 (a): an exception other than an EngineError while the engine thread applied a command (an
    add, an unpin) ended the engine loop: every request of every client failed from then on. It now fails that
    command's request (or caller) only, undoing what it started, and the engine goes on."""
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=128))
    await eng.start()
    output_add, unpin = eng._engine.output.add, eng._engine.unpin_prefix

    def broken_add(group: Any) -> None:      # fault injection: after the core admitted it
        if group.request_id == "bad":
            raise KeyError("injected")
        output_add(group)

    def broken_unpin(token_ids: list[int], salt: object = (), tenant: str = "", forget: bool = False) -> int:
        raise ValueError("injected unpin fault")
    eng._engine.output.add = broken_add      # type: ignore[method-assign]
    eng._engine.unpin_prefix = broken_unpin  # type: ignore[method-assign]
    try:
        good = eng.add(toks(6, 1), SamplingParams(max_tokens=6, ignore_eos=True), request_id="good")
        with pytest.raises(EngineError, match="injected"):
            async for _ in eng.generate(toks(6, 2), SamplingParams(max_tokens=6, ignore_eos=True), request_id="bad"):
                pass
        with pytest.raises(EngineError, match="injected unpin fault"):
            await asyncio.wait_for(eng.unpin_prefix(toks(8, 3)), 30)
        assert eng.is_running
        outs = await good.final()
        assert len(outs[0].outputs[0].token_ids) == 6 and outs[0].finished
        eng._engine.unpin_prefix = unpin         # type: ignore[method-assign]
        n = 0
        async for out in eng.generate(toks(6, 4), SamplingParams(max_tokens=5, ignore_eos=True)):
            n += len(out.outputs[0].token_ids)
        assert n == 5 and eng.stats().kv_blocks_used == 0 and not eng._engine.request_ids
    finally:
        eng._engine.output.add = output_add      # type: ignore[method-assign]
        await eng.shutdown()


async def test_a_request_id_reused_right_after_an_abort_gets_only_its_own_outputs(tiny_llama_dir: Path) -> None:
    """Issue 24, item 20 (c): outputs of a step that ran before an abort reached the engine thread were delivered by
    request id, so a new request reusing the id at once got the old request's tokens. Ids are now unique per life
    inside the engine; each stream sees its own request's outputs only."""
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=128))
    await eng.start()
    try:
        for attempt in range(3):
            old, new = toks(7, 10 + attempt), toks(9, 20 + attempt)
            first = eng.add(old, SamplingParams(max_tokens=40, ignore_eos=True), request_id="same")
            await first.get()                       # it runs; the next step is already under way
            first.abort()
            again = eng.add(new, SamplingParams(max_tokens=3, ignore_eos=True), request_id="same")
            outs: list[RequestOutput] = []
            while not again.finished:
                outs += await again.get()
            assert outs and all(o.request_id == "same" and o.prompt_token_ids == new for o in outs), \
                [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]
            assert sum(len(o.outputs[0].token_ids) for o in outs) == 3
    finally:
        await eng.shutdown()


async def test_the_encoding_thread_has_a_tokenizer_of_its_own(tiny_llama_dir: Path) -> None:
    """Issue 24, item 20 (e): one tokenizer object served the service's tokenizer thread (which encodes message
    content with special tokens split, a setting the Rust object keeps), the engine thread and the grammar thread,
    under a rule nobody wrote down. The caller's encoding tokenizer is now a copy: encoding with it leaves the
    engine's settings (and so its grammars' view of the vocabulary) alone, and both tokenize alike."""
    eng = AsyncEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=64))
    engine_side = eng._engine.tokenizer
    eng.tokenizer("<|im_end|> hi", add_special_tokens=False, split_special_tokens=True)
    assert eng.tokenizer._tokenizer.encode_special_tokens                    # the setting sticks to the object...
    assert not engine_side._tokenizer.encode_special_tokens                  # ...that the engine does not share
    text = "<|im_start|>user\\nhello world<|im_end|>"
    assert eng.tokenizer.encode(text) == engine_side.encode(text) and eng.tokenizer.chat_template == \
        engine_side.chat_template
    await eng.start()
    await eng.shutdown()
