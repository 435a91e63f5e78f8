"""The official openai client against a real server: completions and chat, streaming and not."""
from __future__ import annotations

import asyncio

import torch
from openai import AsyncOpenAI, OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.server import ServerThread

PROMPT = "The model reads the prompt and"


def test_completion_matches_transformers_greedy(client: OpenAI, model_name: str, tiny_llama_dir) -> None:
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    ours = choice.model_extra["token_ids"]
    assert len(ours) == 24 and choice.finish_reason == "length"

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert out.model_extra["prompt_token_ids"] == [ids[0].tolist()]
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert ours == ref
    assert choice.text == tok.decode(ref)
    assert out.usage.prompt_tokens == ids.shape[1] and out.usage.completion_tokens == 24


def test_streamed_completion_equals_non_streamed(client: OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 10, "streamed in one piece"
    assert "".join(texts) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_equals_non_streamed(client: OpenAI, model_name: str) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]
    kw = dict(model=model_name, messages=messages, max_tokens=30, temperature=0)
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert whole.usage.prompt_tokens > 10


def test_chat_prompt_uses_template(client: OpenAI, model_name: str, server: ServerThread) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    out = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=3,
                                         extra_body={"return_token_ids": True})
    tok = server.state.engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True,
                                   tokenize=False)
    assert out.model_extra["prompt_token_ids"] == tok.encode(text, add_special_tokens=False)
    assert out.usage.completion_tokens <= 3


def test_prompt_forms_and_n(client: OpenAI, model_name: str, server: ServerThread) -> None:
    tok = server.state.engine.tokenizer
    ids = [tok.encode("hello world"), tok.encode("the cache block")]
    base = dict(model=model_name, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    by_text = client.completions.create(prompt=["hello world", "the cache block"], **base)
    by_ids = client.completions.create(prompt=ids, **base)
    single_ids = client.completions.create(prompt=ids[1], **base)
    assert [c.index for c in by_text.choices] == [0, 1]
    assert [c.text for c in by_text.choices] == [c.text for c in by_ids.choices]
    assert single_ids.choices[0].text == by_text.choices[1].text
    assert by_text.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    # n samples per prompt, seeded: index = prompt * n + sample; seeds differ per sample
    sampled = client.completions.create(prompt=["hello world", "the cache block"], n=3, seed=7,
                                        **{**base, "temperature": 1.0})
    assert [c.index for c in sampled.choices] == list(range(6))
    again = client.completions.create(prompt=["hello world", "the cache block"], n=3, seed=7,
                                      **{**base, "temperature": 1.0})
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]
    assert len({c.text for c in sampled.choices[:3]}) > 1
    assert sampled.usage.completion_tokens == 6 * 8


def test_cached_tokens_reported(client: OpenAI, model_name: str) -> None:
    prompt = "prefix cache " * 20   # several full 16-token blocks
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=model_name, prompt=prompt, max_tokens=2)
    n = first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= (n - 1) // 16 * 16 > 0
    assert second.usage.prompt_tokens_details.cached_tokens < n


def test_models(client: OpenAI, model_name: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]


async def test_async_client_concurrent_streams(server: ServerThread, model_name: str) -> None:
    async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as ac:
        async def one(i: int) -> str:
            stream = await ac.completions.create(model=model_name, prompt=f"{i} hello", max_tokens=12,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream])

        async def whole(i: int) -> str:
            out = await ac.completions.create(model=model_name, prompt=f"{i} hello", max_tokens=12,
                                              temperature=0, extra_body={"ignore_eos": True})
            return out.choices[0].text

        streamed = await asyncio.gather(*(one(i) for i in range(8)))
        plain = await asyncio.gather(*(whole(i) for i in range(8)))
    assert streamed == plain
    assert len(set(streamed)) > 1
