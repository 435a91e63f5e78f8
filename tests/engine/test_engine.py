"""Engine behaviour on a tiny checkpoint: pins under pressure, refusals, aborts, seeds, stop strings."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, EngineConfig, InvalidRequest, PinCapExceeded, SamplingParams
from engine.llm_engine import LLMEngine


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def test_pinned_prefix_survives_pressure_unpinned_one_is_evicted(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=40)
    pinned, seen = toks(16, 1), toks(16, 2)
    assert llm.pin_prefix(pinned).num_pinned_blocks == 4
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([seen + [5]], greedy)
    assert llm.generate([seen + [6]], greedy)[0].num_cached_tokens == 16      # seen: cached for now
    for i in range(12):                                                      # flood with unrelated prompts
        llm.generate([toks(40, 100 + i)], greedy)
    assert llm.generate([pinned + [7]], greedy)[0].num_cached_tokens == 16    # pinned: still all there
    assert llm.generate([seen + [8]], greedy)[0].num_cached_tokens == 0       # seen: evicted
    stats = llm.stats()
    assert stats.kv_blocks_used == stats.kv_blocks_pinned == 4
    assert llm.unpin_prefix(pinned) == 4
    assert llm.stats().kv_blocks_pinned == 0 and llm.stats().kv_blocks_used == 0
    assert not llm.engine.request_ids                                           # the pin request is gone too


def test_pin_over_cap_refused_whole(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=20, pinned_fraction=0.5)  # cap 10 blocks
    llm.pin_prefix(toks(32, 3))                                                # 8 blocks
    with pytest.raises(PinCapExceeded):
        llm.pin_prefix(toks(12, 4))                                            # 3 more > 10
    assert llm.stats().kv_blocks_pinned == 8 and llm.stats().kv_blocks_used == 8
    again = llm.pin_prefix(toks(32, 3))                                        # same prefix: no new blocks
    assert again.num_pinned_blocks == 8 and llm.stats().kv_blocks_pinned == 8


def test_requests_that_can_never_fit_are_refused_at_add(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=10, max_model_len=64))
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("a", toks(70, 5), SamplingParams(max_tokens=1))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("b", toks(20, 5), SamplingParams(max_tokens=50))
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequest):                                        # 48 tokens > 10 blocks of 4
        engine.add_request("c", toks(40, 5), SamplingParams(max_tokens=8))
    with pytest.raises(InvalidRequest):
        engine.add_request("d", [], SamplingParams())
    with pytest.raises(InvalidRequest):
        engine.add_request("e", [10**6], SamplingParams())
    assert not engine.has_unfinished()


def test_abort_frees_every_block(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=64))
    for i in range(4):
        engine.add_request(f"r{i}", toks(10 + i, i), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().kv_blocks_used > 0
    outs = [engine.abort(f"r{i}") for i in range(4)]
    assert all(o is not None and o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished()
    assert engine.abort("r0") is None                                           # idempotent


def test_seeded_sampling_independent_of_batch(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=256)
    p = toks(12, 9)
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    alone = llm.generate([p], seeded)[0].outputs[0].token_ids
    crowd = [toks(5 + i, 50 + i) for i in range(5)]
    mixed = llm.generate(crowd[:2] + [p] + crowd[2:], [SamplingParams(temperature=1.0, max_tokens=16)] * 2
                         + [seeded] + [SamplingParams(temperature=0.7, max_tokens=9)] * 3)
    assert mixed[2].outputs[0].token_ids == alone
    other = llm.generate([p], SamplingParams(temperature=1.0, seed=43, max_tokens=16, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone


def test_seeded_sampling_independent_of_cache_state_and_preemption(tiny_llama_dir: Path) -> None:
    """The same seeded request gives the same tokens cold, with its prompt cached, and when it is preempted
    (its KV dropped and recomputed) under a cache too small for the crowd beside it."""
    p = toks(30, 11)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    roomy = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=256)
    cold = roomy.generate([p], seeded)[0]
    warm = roomy.generate([p], seeded)[0]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens >= 24
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    tight = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=30, max_num_batched_tokens=32)
    crowd = [toks(20, 70 + i) for i in range(4)]
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True) for i in range(4)]
    out = tight.generate(crowd + [p], others + [seeded])      # the youngest: the first to be preempted
    assert tight.stats().preemptions_total > 0, "the cache was meant to be small enough to force preemption"
    assert out[-1].outputs[0].token_ids == cold.outputs[0].token_ids


def test_stop_string_cut_and_deltas_match_text(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=128)
    p = toks(8, 11)
    full = llm.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    text = full.text
    assert text == llm.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3
    cut = llm.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:text.index(stop)]


def test_a_degenerate_temperature_harms_no_neighbour(tiny_llama_dir: Path) -> None:
    """temperature 1e-300 used to turn float32 logits into inf/NaN and fail the whole step."""
    llm = LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=128)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    alone = llm.generate([toks(9, 1)], greedy)[0].outputs[0].token_ids
    outs = llm.generate([toks(9, 1), toks(9, 2), toks(9, 3)],
                        [greedy, SamplingParams(temperature=1e-300, max_tokens=10, ignore_eos=True),
                         SamplingParams(temperature=1e-40, max_tokens=10, ignore_eos=True)])
    assert outs[0].outputs[0].token_ids == alone
    assert [len(o.outputs[0].token_ids) for o in outs] == [10, 10, 10] and all(o.error is None for o in outs)


def test_non_finite_logits_fail_only_their_request(tiny_llama_dir: Path) -> None:
    """Fault injection at the sampling stage: one request's logits turn NaN mid-run."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=128))
    core = engine.core
    real = core._sample

    def poisoned(logits, targets):  # type: ignore[no-untyped-def]
        for i, seq in enumerate(targets):
            if seq.request_id == "bad" and seq.num_output_tokens == 2:
                logits[i, 0] = float("nan")
        return real(logits, targets)

    core._sample = poisoned  # type: ignore[method-assign]
    for rid in ("a", "bad", "b"):
        engine.add_request(rid, toks(6, ord(rid[0])), SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
    done: dict[str, object] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["bad"].error is not None and "non-finite" in done["bad"].error.message  # type: ignore[attr-defined]
    assert all(done[r].error is None for r in ("a", "b"))  # type: ignore[attr-defined]
    assert engine.stats().kv_blocks_used == 0


def test_chunked_prefill_under_python_O(tiny_llama_dir: Path) -> None:
    """Issue 24: a block grow lived inside an `assert`, so under `python -O` chunked prefill ran without its
    blocks (an IndexError that aborted every request). The same greedy tokens with and without -O."""
    import subprocess
    import sys
    script = ("import sys; from engine import LLM, SamplingParams; "
              f"llm = LLM({str(tiny_llama_dir)!r}, block_size=4, num_kv_blocks=64, max_num_batched_tokens=8); "
              "out = llm.generate([list(range(5, 40)), list(range(50, 70))], "
              "SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)); "
              "print([o.outputs[0].token_ids for o in out])")
    runs = [subprocess.run([sys.executable, *flag, "-c", script], capture_output=True, text=True, timeout=300,
                           cwd=Path(__file__).resolve().parents[2]) for flag in ([], ["-O"])]
    for r in runs:
        assert r.returncode == 0, r.stderr[-1500:]
    assert runs[0].stdout.strip().splitlines()[-1] == runs[1].stdout.strip().splitlines()[-1]


def _run(engine: LLMEngine, max_steps: int) -> dict[str, object]:
    """Steps until nothing is left, at most `max_steps` (a livelocked engine fails here); the final outputs."""
    done: dict[str, object] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError(f"still running after {max_steps} steps: {engine.request_ids}, {engine.stats()}")


def test_beam_width_over_max_num_seqs_is_refused(tiny_llama_dir: Path) -> None:
    """Issue 24, item 18 (reproduced): beams computed their step and waited for a preempted sibling that could
    only come back through admission, capped at max_num_seqs by the very beams waiting for it: the engine spun
    forever on one request. A width (or best_of) over max_num_seqs is refused when added."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=128, max_num_seqs=2))
    beams = SamplingParams(n=1, best_of=4, use_beam_search=True, temperature=0, max_tokens=12, ignore_eos=True)
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("wide", toks(10, 7), beams)
    assert e.value.param == "best_of" and "max_num_seqs" in e.value.message
    with pytest.raises(InvalidRequest):
        engine.add_request("many", toks(10, 7), SamplingParams(n=3, max_tokens=4))
    engine.add_request("fits", toks(10, 7), SamplingParams(n=1, best_of=2, use_beam_search=True, temperature=0,
                                                           max_tokens=12, ignore_eos=True))
    assert _run(engine, 200)["fits"].outputs[0].finish_reason == "length"     # type: ignore[attr-defined]
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("batched", [512, 5])     # 5: a step computes some beams of the group, not all
def test_a_beam_group_under_preemption_pressure_completes(tiny_llama_dir: Path, batched: int) -> None:
    """Item 18 (and 20: a preempted beam kept its pending log-probabilities, so the search could step, and fork
    from it, while it waited without blocks): a beam group is preempted as a unit, forgets its logits and is
    readmitted whole, so no beam waits on a sibling that cannot come back and every beam the search steps on
    runs with its blocks. Under pressure the search ends, with the tokens it finds alone, and frees every block."""
    from engine.sequence import Status
    beams = SamplingParams(n=2, best_of=4, use_beam_search=True, temperature=0, max_tokens=24, ignore_eos=True)
    prompt = toks(14, 9)
    alone = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=128, max_num_seqs=8))
    alone.add_request("beam", prompt, beams)
    expected = [o.token_ids for o in _run(alone, 400)["beam"].outputs]          # type: ignore[attr-defined]
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=32, max_num_seqs=6,
                                    max_num_batched_tokens=batched))
    forks, manager = engine.core.forks, engine.core.manager
    stepped_on: list[list[tuple[Status, bool]]] = []
    beam_step = forks.beam_step

    def observed(group):  # type: ignore[no-untyped-def]
        stepped_on.append([(s.status, s.seq_id in manager._seqs) for s in group.seqs])
        beam_step(group)
    forks.beam_step = observed  # type: ignore[method-assign]
    for i in range(3):
        engine.add_request(f"other{i}", toks(12, 20 + i), SamplingParams(max_tokens=40, ignore_eos=True))
    engine.add_request("beam", prompt, beams)
    done = _run(engine, 2000)
    assert engine.stats().preemptions_total > 0 and len(stepped_on) >= 20
    assert all(state == (Status.RUNNING, True) for beams_then in stepped_on for state in beams_then), stepped_on
    assert [o.token_ids for o in done["beam"].outputs] == expected            # type: ignore[attr-defined]
    assert all(done[f"other{i}"].outputs[0].finish_reason == "length" for i in range(3))   # type: ignore[attr-defined]
    assert engine.stats().kv_blocks_used == 0


def test_a_preempted_beam_forgets_its_logits_and_takes_its_siblings(tiny_llama_dir: Path) -> None:
    """Issue 24, item 20 (b): a beam preempted after computing its logits kept them, so the search could step with
    it waiting without blocks, and fork from it (a child sharing no blocks). Preempting a beam now preempts its
    running siblings too, each forgetting its logits; the group comes back whole and the search ends as alone."""
    from engine.sched.scheduler import SchedulerOutput
    from engine.sequence import Status
    beams = SamplingParams(n=1, best_of=4, use_beam_search=True, temperature=0, max_tokens=10, ignore_eos=True)
    alone = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=128))
    alone.add_request("beam", toks(9, 4), beams)
    expected = _run(alone, 400)["beam"].outputs[0].token_ids                    # type: ignore[attr-defined]
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=128,
                                    max_num_batched_tokens=2))               # two of the four beams a step
    engine.add_request("beam", toks(9, 4), beams)
    group = engine.core.requests["beam"]
    while not [s for s in group.seqs if s.pending_logprobs is not None]:
        engine.step()
    pending = next(s for s in group.seqs if s.pending_logprobs is not None)
    sched = engine.core.scheduler
    sched._preempt(pending, SchedulerOutput(), set())
    held = engine.core.manager._seqs                                           # seq id -> its blocks
    assert all(s.status is Status.WAITING and s.pending_logprobs is None and s.seq_id not in held for s in group.seqs)
    assert _run(engine, 400)["beam"].outputs[0].token_ids == expected          # type: ignore[attr-defined]
    assert engine.stats().kv_blocks_used == 0


def test_a_step_lists_each_touched_request_once_in_constant_time() -> None:
    """CoreOutput.touch is a set lookup, not a scan of the groups listed so far (which made a step of S
    sampled sequences O(S^2)): 20,000 groups touched twice each take well under a second (the scan: minutes)."""
    import time
    from types import SimpleNamespace

    from engine.core import CoreOutput

    out = CoreOutput()
    groups = [SimpleNamespace(i=i) for i in range(20_000)]
    t = time.perf_counter()
    for g in groups + groups[::-1]:
        out.touch(g)  # type: ignore[arg-type]
    assert time.perf_counter() - t < 1.0
    assert out.groups == groups                       # each once, in first-touch order
