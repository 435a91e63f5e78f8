"""Parallel sampling and beam search share KV blocks by reference count and copy-on-write, and beam
search equals transformers' `generate(num_beams=...)`."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def test_greedy_n4_equals_n1(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=256)
    p = toks(10, 1)
    one = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs
    four = llm.generate([p], SamplingParams(n=4, temperature=0, max_tokens=12, ignore_eos=True))[0].outputs
    assert [o.index for o in four] == [0, 1, 2, 3]
    assert all(o.token_ids == one[0].token_ids and o.text == one[0].text for o in four)
    assert llm.stats().kv_blocks_used == 0


def test_seeded_samples_reproducible_and_distinct(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=256)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    a = [o.token_ids for o in llm.generate([toks(9, 2)], params)[0].outputs]
    b = [o.token_ids for o in llm.generate([toks(9, 2)], params)[0].outputs]
    assert a == b
    assert len({tuple(x) for x in a}) == 4
    single = llm.generate([toks(9, 2)], SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True))
    assert single[0].outputs[0].token_ids == a[0]          # sample 0 of a seeded request == the n=1 request


def test_best_of_returns_the_n_most_likely(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=256)
    outs = llm.generate([toks(9, 3)], SamplingParams(n=2, best_of=5, temperature=1.0, seed=1, max_tokens=8,
                                                     ignore_eos=True))[0].outputs
    every = llm.generate([toks(9, 3)], SamplingParams(n=5, temperature=1.0, seed=1, max_tokens=8,
                                                      ignore_eos=True))[0].outputs
    best = sorted(every, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in outs] == [o.token_ids for o in best]


def test_copy_on_write_forks_match_independent_runs(tiny_llama_dir: Path) -> None:
    """Four forks write different tokens into a shared partial block; each must equal a single
    sequence that was given the same tokens (its KV was not corrupted by the others)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=8, num_kv_blocks=128))
    prompt = toks(13, 4)                                     # 13 = one full block + a shared partial one
    group = engine.add_request("fork", prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=10,
                                                              ignore_eos=True))
    engine.step()                                            # prefill + fork: 4 sequences share blocks
    seqs = list(group.seqs)
    tables = [engine.core.manager.block_table(s.seq_id) for s in seqs]
    assert all(t == tables[0] for t in tables)              # full sharing right after the fork
    assert engine.stats().kv_blocks_used == 2
    engine.step()                                            # each writes its first token: CoW
    tables = [engine.core.manager.block_table(s.seq_id) for s in seqs]
    assert len({t[0] for t in tables}) == 1                  # the full block stays shared
    assert len({t[1] for t in tables}) == 4                  # the partial block was copied
    while engine.has_unfinished():
        engine.step()
    for s in seqs:
        # the fork's log-probabilities equal those of one sequence teacher-forced with the same tokens:
        # had another fork written into its KV, they would not
        forced = _teacher_forced_logprob(tiny_llama_dir, prompt, s.output_token_ids)
        assert s.cumulative_logprob == pytest.approx(forced, abs=1e-3)
    assert engine.stats().kv_blocks_used == 0


def _teacher_forced_logprob(path: Path, prompt: list[int], out: list[int]) -> float:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
    return float(sum(logp[len(prompt) - 1 + i, t] for i, t in enumerate(out)))


@pytest.mark.parametrize("n", [2, 4, 6])
def test_parallel_sampling_block_accounting(tiny_llama_dir: Path, n: int) -> None:
    b = 4
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=b, num_kv_blocks=256))
    prompt = toks(18, 5)                                     # 4 full blocks + 2 tokens in a partial one
    engine.add_request("x", prompt, SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=7, ignore_eos=True))
    engine.step()                                            # prompt computed once, forked
    assert engine.stats().kv_blocks_used == 5                # shared: 4 full + 1 partial
    engine.step()
    # after the first write: 4 shared full blocks, and n private copies of the partial one
    assert engine.stats().kv_blocks_used == 4 + n
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().kv_blocks_used == 0


def test_abort_mid_fork_frees_everything(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=256))
    engine.add_request("s", toks(18, 6), SamplingParams(n=4, temperature=1.0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", toks(18, 7), SamplingParams(best_of=4, use_beam_search=True, temperature=0,
                                                        max_tokens=50, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.stats().kv_blocks_used > 0
    for rid in ("s", "b"):
        out = engine.abort(rid)
        assert out is not None and out.finished
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("width", [2, 4, 6])
def test_beam_search_block_accounting(tiny_llama_dir: Path, width: int) -> None:
    b = 4
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=b, num_kv_blocks=512))
    prompt = toks(16, 8)                                     # exactly 4 full blocks
    group = engine.add_request("beam", prompt, SamplingParams(best_of=width, use_beam_search=True, max_tokens=12,
                                                              ignore_eos=True))
    engine.step()
    assert len(group.seqs) == width
    for _ in range(5):
        # every live beam holds the 4 shared prompt blocks plus its own (possibly shared) output blocks;
        # blocks in use never exceed prompt + width * output blocks, and the prompt is counted once
        engine.step()
        out_blocks = {bid for s in group.seqs for bid in engine.core.manager.block_table(s.seq_id)[4:]}
        prompt_blocks = {bid for s in group.seqs for bid in engine.core.manager.block_table(s.seq_id)[:4]}
        assert len(prompt_blocks) == 4
        assert engine.stats().kv_blocks_used == 4 + len(out_blocks)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("width", [2, 4, 6])
def test_beam_search_equals_transformers(tiny_model_dir: Path, width: int) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    llm = LLM(str(tiny_model_dir), block_size=4, num_kv_blocks=1024)
    rng = random.Random(width)
    n = min(2, width)

    def both(prompt: list[int], length_penalty: float, early_stopping: bool | str,
             eos: int | None) -> tuple[list[list[int]], list[list[int]]]:
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          num_beams=width, num_return_sequences=n, do_sample=False, max_new_tokens=10,
                          length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
                          pad_token_id=0)
        params = SamplingParams(n=n, best_of=width, use_beam_search=True, max_tokens=10, temperature=0,
                                length_penalty=length_penalty, early_stopping=early_stopping, ignore_eos=True,
                                stop_token_ids=[eos] if eos is not None else [])
        got = [o.token_ids for o in llm.generate([prompt], params)[0].outputs]
        # transformers fills hypotheses that ended early with `pad_token_id or eos` (pad 0 is falsy, so
        # with EOS set the fill is EOS itself); compare up to our length
        fill = eos if eos is not None else 0
        expected = [row[len(prompt):].tolist() for row in ref]
        expected = [e[:len(g)] if all(t == fill for t in e[len(g):]) else e for e, g in zip(expected, got)]
        return got, expected

    prompt = [rng.randrange(3, hf.config.vocab_size) for _ in range(11)]
    got, expected = both(prompt, 1.0, False, None)
    assert got == expected
    # Make EOS a token the best beam emits at its 4th step, so hypotheses really end on it, and
    # exercise length_penalty and both early-stopping rules on that path.
    eos = next(t for t in got[0][3:] if t != 0)
    ended_on_eos = 0
    for length_penalty, early_stopping in [(1.0, False), (0.5, True), (2.0, "never")]:
        got, expected = both(prompt, length_penalty, early_stopping, eos)
        assert got == expected
        ended_on_eos += sum(1 for g in got if g and g[-1] == eos)
    assert ended_on_eos > 0, "the EOS path was meant to be taken"
    assert llm.stats().kv_blocks_used == 0


def test_parallel_sampling_through_triton_block_copy(tiny_llama_dir: Path) -> None:
    """CoW through the Triton block-copy kernel gives the same samples as the torch path."""
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    prompt = toks(13, 9)
    runs = [[o.token_ids for o in LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=64,
                                      attention_backend=backend).generate([prompt], params)[0].outputs]
            for backend in ("torch", "triton")]
    assert runs[0] == runs[1]


def test_beam_search_under_preemption_still_equals_transformers(tiny_llama_dir: Path) -> None:
    """Beams preempted for lack of blocks are recomputed; their siblings wait for them, and the search
    ends where transformers' does."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    prompts = [toks(14, 20 + i) for i in range(3)]
    params = SamplingParams(n=2, best_of=4, use_beam_search=True, max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), block_size=2, num_kv_blocks=40, max_num_batched_tokens=16)
    outs = llm.generate(prompts, params)
    assert llm.stats().preemptions_total > 0, "the cache was meant to force preemption"
    for p, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), num_beams=4,
                          num_return_sequences=2, do_sample=False, max_new_tokens=12, eos_token_id=None,
                          pad_token_id=0)
        assert [o.token_ids for o in out.outputs] == [r[len(p):].tolist() for r in ref]
    assert llm.stats().kv_blocks_used == 0
