"""n, best_of, beam search and logprobs over HTTP (official openai client) and the WebSocket.

Each prompt is one engine request that forks its samples; the yardstick for beam search and
log-probabilities is transformers on the same tiny checkpoint.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.server import ServerThread

PROMPT = "The scheduler admits a request when"
# log_softmax of float32 logits from two implementations of the same model (different op order):
# they agree to ~1e-6; 1e-4 leaves room without hiding a wrong token or a temperature-scaled value.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path) -> tuple[Any, Any]:
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return tok, model


@pytest.fixture(autouse=True)
def no_leaks(server: ServerThread) -> Iterator[None]:
    """After each test every request's blocks (every fork's) are back: used == pinned."""
    yield
    engine = server.state.engine
    assert engine is not None
    deadline = time.monotonic() + 5
    while True:
        st = engine.stats()
        if st.requests_running == st.requests_waiting == 0 and st.kv_blocks_used == st.kv_blocks_pinned:
            return
        assert time.monotonic() < deadline, st
        time.sleep(0.02)


def _teacher_forced(model: Any, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """[len(output), V] log-probabilities transformers gives each output position."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    start = len(prompt_ids) - 1
    return torch.log_softmax(logits[start:start + len(output_ids)], dim=-1)


def test_greedy_n3_equals_n1(client: OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    one = client.completions.create(**kw)
    three = client.completions.create(n=3, **kw)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.text for c in three.choices] == [one.choices[0].text] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens          # the prompt counted once
    assert three.usage.completion_tokens == 3 * 12


def test_seeded_n3_reproducible_and_distinct(client: OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11, n=3,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1


def test_best_of_returns_n_best(client: OpenAI, model_name: str) -> None:
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=3,
                                    n=2, best_of=4, logprobs=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.finish_reason == "length" and len(c.logprobs.token_logprobs) == 10 for c in out.choices)
    # the n best by cumulative log-probability, best first
    sums = [sum(c.logprobs.token_logprobs) for c in out.choices]
    assert sums == sorted(sums, reverse=True)
    streamed = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=10, temperature=1.0,
                                              seed=3, n=2, best_of=4, stream=True, extra_body={"ignore_eos": True}))
    texts = {i: "".join(c.choices[0].text for c in streamed if c.choices[0].index == i) for i in (0, 1)}
    assert texts == {0: out.choices[0].text, 1: out.choices[1].text}


def test_beam_search_matches_transformers(client: OpenAI, model_name: str, hf: tuple[Any, Any]) -> None:
    tok, model = hf
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, n=2,
                                    extra_body={"use_beam_search": True, "best_of": 4, "ignore_eos": True,
                                                "return_token_ids": True})
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, num_beams=4, num_return_sequences=2, do_sample=False, max_new_tokens=12,
                             eos_token_id=None, pad_token_id=0)[:, ids.shape[1]:].tolist()
    assert [c.model_extra["token_ids"] for c in out.choices] == ref
    assert [c.text for c in out.choices] == [tok.decode(r) for r in ref]
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, extra_body={"use_beam_search": True, "best_of": 3})
    assert len(chat.choices) == 1 and chat.choices[0].finish_reason in ("stop", "length")


def test_completion_logprobs_match_transformers(client: OpenAI, model_name: str, hf: tuple[Any, Any]) -> None:
    tok, model = hf
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=5,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    gen = choice.model_extra["token_ids"]
    ref = _teacher_forced(model, out.model_extra["prompt_token_ids"][0], gen)
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([t]) for t in gen]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), ref[range(len(gen)), gen],
                               atol=LOGPROB_TOL, rtol=0)
    values, top_ids = ref.topk(5, dim=-1)
    for i, top in enumerate(lp.top_logprobs):
        # keyed by string (the legacy shape): two ids that decode alike (say, halves of characters,
        # both U+FFFD) share one key, which keeps the likelier one
        expected: dict[str, float] = {}
        for t, v in zip(top_ids[i].tolist(), values[i].tolist()):
            expected.setdefault(tok.decode([t]), v)
        assert list(top) == list(expected) and list(top)[0] == lp.tokens[i]          # greedy: top 1
        torch.testing.assert_close(torch.tensor(list(top.values())), torch.tensor(list(expected.values())),
                                   atol=LOGPROB_TOL, rtol=0)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(gen))]
    assert "".join(lp.tokens) == choice.text


def test_chat_logprobs_match_transformers(client: OpenAI, model_name: str, hf: tuple[Any, Any]) -> None:
    tok, model = hf
    out = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Say hi"}],
                                         max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    gen = choice.model_extra["token_ids"]
    ref = _teacher_forced(model, out.model_extra["prompt_token_ids"], gen)
    content = choice.logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in gen]
    torch.testing.assert_close(torch.tensor([c.logprob for c in content]), ref[range(len(gen)), gen],
                               atol=LOGPROB_TOL, rtol=0)
    values, _ = ref.topk(3, dim=-1)
    for i, c in enumerate(content):
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        torch.testing.assert_close(torch.tensor([t.logprob for t in c.top_logprobs]), values[i],
                                   atol=LOGPROB_TOL, rtol=0)
    # a token's bytes are its own (even half a UTF-8 character): together they spell the answer
    if not any(t in tok.all_special_ids for t in gen):
        assert bytes(b for c in content for b in c.bytes).decode(errors="replace") == choice.message.content
    # no logprobs asked: none given
    plain = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Say hi"}],
                                           max_tokens=2, logprobs=False)
    assert plain.choices[0].logprobs is None


def test_streaming_n2_indexes_and_logprobs(client: OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=5, n=2, logprobs=2,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert {c.choices[0].index for c in chunks} == {0, 1}
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [x for c in mine for x in c.logprobs.token_logprobs] == choice.logprobs.token_logprobs
        assert [x for c in mine for x in c.logprobs.text_offset] == choice.logprobs.text_offset
        assert mine[-1].finish_reason == "length"
    chat_kw = dict(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=2, seed=5,
                   temperature=1.0)
    chat_whole = client.chat.completions.create(**chat_kw)
    chat_chunks = list(client.chat.completions.create(stream=True, **chat_kw))
    for choice in chat_whole.choices:
        mine = [c.choices[0] for c in chat_chunks if c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("chat, fields, param", [
    (False, {"n": 2, "best_of": 1}, "best_of"),
    (False, {"best_of": "4"}, "best_of"),
    (False, {"best_of": 10_000}, "best_of"),
    (False, {"prompt": ["a"] * 100, "best_of": 2}, "best_of"),
    (False, {"use_beam_search": "yes"}, "use_beam_search"),
    (False, {"use_beam_search": True, "top_p": 0.5}, "use_beam_search"),
    (False, {"use_beam_search": True, "stop": ["x"]}, "stop"),
    (False, {"use_beam_search": True, "logprobs": 2}, "logprobs"),
    (False, {"length_penalty": "long"}, "length_penalty"),
    (False, {"length_penalty": 1e6}, "length_penalty"),
    (False, {"early_stopping": "sometimes"}, "early_stopping"),
    (False, {"early_stopping": 1}, "early_stopping"),
    (False, {"logprobs": 21}, "logprobs"),
    (False, {"logprobs": -1}, "logprobs"),
    (False, {"logprobs": True}, "logprobs"),
    (True, {"logprobs": 3}, "logprobs"),
    (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (True, {"logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
    (True, {"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_sampling_values_are_400(client: OpenAI, model_name: str, chat: bool, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        if chat:
            client.chat.completions.create(model=model_name, messages=MSG, max_tokens=2, extra_body=fields)
        else:
            body = {"prompt": PROMPT, **fields}
            client.completions.create(model=model_name, prompt=body.pop("prompt"), max_tokens=2, extra_body=body)
    assert exc.value.param == param and exc.value.type == "invalid_request_error"


async def test_websocket_n_best_of_and_logprobs(server: ServerThread, model_name: str, client: OpenAI) -> None:
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 9, "n": 2,
            "logprobs": 1, "ignore_eos": True}
    http = client.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                     extra_body={"ignore_eos": True})
    async with aiohttp.ClientSession() as s, s.ws_connect(f"{server.url}/v1/ws") as ws:
        await ws.send_json({"type": "generate", "id": "s", **body})
        await ws.send_json({"type": "generate", "id": "b", "model": model_name, "prompt": PROMPT, "max_tokens": 6,
                            "use_beam_search": True, "best_of": 3, "n": 2, "ignore_eos": True})
        frames: list[dict] = []
        while sum(f["type"] in ("done", "error") for f in frames) < 2:
            frames.append(json.loads((await asyncio.wait_for(ws.receive(), 30)).data))
    assert not [f for f in frames if f["type"] == "error"], frames
    for choice in http.choices:
        mine = [f for f in frames if f["type"] == "delta" and f["id"] == "s" and f["index"] == choice.index]
        assert "".join(f["text"] for f in mine) == choice.text
        # batched with the beam request, not alone as over HTTP: the same values up to float rounding
        assert [e["logprob"] for f in mine for e in f["logprobs"]] == pytest.approx(choice.logprobs.token_logprobs,
                                                                                   abs=LOGPROB_TOL)
        assert all(len(f["logprobs"]) == len(f["token_ids"]) for f in mine)
    beams = [f for f in frames if f["type"] == "delta" and f["id"] == "b"]
    assert sorted(f["index"] for f in beams) == [0, 1] and all(len(f["token_ids"]) == 6 for f in beams)
    (done,) = [f for f in frames if f["type"] == "done" and f["id"] == "b"]
    assert [c["finish_reason"] for c in done["choices"]] == ["length", "length"]


def test_echo_scores_the_prompt_like_transformers(client: OpenAI, model_name: str, hf: tuple[Any, Any],
                                                  server: ServerThread) -> None:
    """What lm-eval sends for a log-likelihood: echo, max_tokens 0, logprobs. The prompt comes back as the
    text, with the log-probability transformers gives each prompt token (the first has none)."""
    tok, model = hf
    ids = tok(PROMPT).input_ids
    ref = _teacher_forced(model, ids[:1], ids[1:])                      # [len - 1, V]
    for _ in range(2):                                                  # the second time the prompt is cached
        out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
        choice = out.choices[0]
        assert choice.text == PROMPT and choice.finish_reason == "length"
        lp = choice.logprobs
        assert lp.tokens == [tok.decode([t]) for t in ids] and lp.token_logprobs[0] is None
        torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), ref[range(len(ids) - 1), ids[1:]],
                                   atol=LOGPROB_TOL, rtol=0)
        assert lp.top_logprobs[0] is None and all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])
        assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens_details.cached_tokens == 0
    # echo with generation, streamed: the prompt leads the first chunk, then the tokens follow
    stream = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, echo=True, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].text for c in stream)
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    assert text == PROMPT + plain
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0)
    assert exc.value.param == "max_tokens"


def test_prompt_logprobs_survive_chunked_prefill(tiny_llama_dir: Path, hf: tuple[Any, Any]) -> None:
    from engine import LLM, SamplingParams
    tok, model = hf
    ids = tok(PROMPT * 6).input_ids
    ref = _teacher_forced(model, ids[:1], ids[1:])
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=256, max_num_batched_tokens=16)
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))           # warm the cache: it is skipped
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0 and out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    got = [d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:])]             # type: ignore[index]
    torch.testing.assert_close(torch.tensor(got), ref[range(len(ids) - 1), ids[1:]], atol=LOGPROB_TOL, rtol=0)
    assert llm.stats().kv_blocks_used == 0


def test_sampling_controls_through_the_openai_client(client: OpenAI, model_name: str, server: ServerThread) -> None:
    tok = server.state.engine.tokenizer  # type: ignore[union-attr]
    forced = tok.encode(" cache", add_special_tokens=False)[0]
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5, temperature=0,
                                    logit_bias={str(forced): 100}, extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == [forced] * 5
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = plain.choices[0].model_extra["token_ids"]
    if len(set(ids)) < len(ids):                  # greedy repeats itself: a penalty must change that
        penalized = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                              frequency_penalty=2.0, presence_penalty=2.0,
                                              extra_body={"return_token_ids": True, "ignore_eos": True})
        assert penalized.choices[0].model_extra["token_ids"] != ids
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0.7, seed=1,
                                          extra_body={"min_p": 0.2, "repetition_penalty": 1.3, "min_tokens": 2})
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens >= 2
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, presence_penalty=3.0)
    assert exc.value.param == "presence_penalty"


@pytest.mark.parametrize("fields", [{"n": 2}, {"n": 2, "best_of": 3}, {"use_beam_search": True, "best_of": 3, "n": 2}],
                         ids=["n", "best_of", "beam"])
async def test_max_tokens_0_with_several_sequences_answers_on_every_surface(
        client: OpenAI, model_name: str, server: ServerThread, fields: dict[str, Any]) -> None:
    """lm-eval's echo scoring and a cache warm-up (`max_tokens: 0`) with n, best_of or beams > 1 answer at once,
    one empty choice per n, whole or streamed, over HTTP and the WebSocket (they used to wait forever: the
    first sequence ended after its prefill and nothing forked the others)."""
    quick = client.with_options(timeout=15)
    logprobs = None if fields.get("use_beam_search") else 1
    whole = quick.completions.create(model=model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=logprobs,
                                     extra_body=fields)
    assert [(c.index, c.text, c.finish_reason) for c in whole.choices] == [(0, PROMPT, "length"),
                                                                          (1, PROMPT, "length")]
    assert whole.usage.completion_tokens == 0
    if logprobs is not None:
        assert [c.logprobs.token_logprobs for c in whole.choices][0][1:] == \
            [c.logprobs.token_logprobs for c in whole.choices][1][1:]
    chunks = list(quick.completions.create(model=model_name, prompt=PROMPT, max_tokens=0, echo=True, stream=True,
                                           extra_body=fields))
    assert sorted((c.choices[0].index, c.choices[0].finish_reason) for c in chunks
                  if c.choices and c.choices[0].finish_reason) == [(0, "length"), (1, "length")]
    warm = quick.chat.completions.create(model=model_name, messages=MSG, max_tokens=0,
                                         extra_body={**fields, "prompt_cache_key": f"warm-{len(fields)}"})
    assert [(c.index, c.finish_reason) for c in warm.choices] == [(0, "length"), (1, "length")]
    async with aiohttp.ClientSession() as s, s.ws_connect(f"{server.url}/v1/ws") as ws:
        await ws.send_json({"type": "generate", "id": "z", "model": model_name, "prompt": PROMPT, "max_tokens": 0,
                            "echo": True, **fields})
        frames: list[dict] = []
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(json.loads((await asyncio.wait_for(ws.receive(), 15)).data))
    assert frames[-1]["type"] == "done", frames
    assert [c["finish_reason"] for c in frames[-1]["choices"]] == ["length", "length"]
