"""SegmentTokens (service/openai/segments.py): a long system prompt resent with every request is encoded once, and
the ids are exactly the tokenizer's own; a tokenizer the cut would change is encoded whole; the kept ids are
bounded; a salt (a tenant) never hits another's text. Real tokenizers: the tiny checkpoint's byte-level BPE, and
that tokenizer given a special token that takes the spaces beside it."""
from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from tokenizers import AddedToken
from transformers import AutoTokenizer

from service.openai.render import render_messages
from service.openai.segments import SegmentTokens
from tests.helpers.server import ServerThread, fresh_system_prompt, http

WORDS = ["policy", "the", "answer", " spaced  out ", "line\n", "ünïcode", "rule", "\n\n", "12.5%", "don't"]


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def text(rng: random.Random, chars: int) -> str:
    out = ""
    while len(out) < chars:
        out += rng.choice(WORDS) + rng.choice([" ", "", "  ", "\n"])
    return out


def chat(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def test_a_long_system_prompt_is_encoded_once_with_the_tokenizers_own_ids(tok: Any) -> None:
    seg = SegmentTokens(min_chars=256)
    rng = random.Random(0)
    system = text(rng, 3000)
    for i in range(6):
        msgs = chat(system, text(rng, 40 + 37 * i))       # questions of 40 to 225 characters: encoded each time
        assert render_messages(msgs, tok, True, segments=seg, salt=None) == render_messages(msgs, tok, True)
    assert (seg.misses, seg.hits) == (1, 5)
    # a stretch is kept per salt: another tenant's first request encodes it again, its second hits
    for _ in range(2):
        render_messages(chat(system, "q"), tok, True, segments=seg, salt="tenant:b")
    assert (seg.misses, seg.hits) == (2, 6)


def test_text_around_special_tokens_keeps_its_ids(tok: Any) -> None:
    # Long stretches between the template's special tokens in every position: first, between, last; spaces and
    # newlines at both ends of each.
    seg = SegmentTokens(min_chars=64)
    rng = random.Random(1)
    for _ in range(20):
        msgs = [{"role": r, "content": rng.choice(["", " ", "\n"]) + text(rng, rng.randrange(60, 400))
                 + rng.choice(["", " ", "\n"])} for r in ("system", "user", "assistant", "user")]
        for gen in (True, False):
            assert render_messages(msgs, tok, gen, segments=seg, salt=None) == render_messages(msgs, tok, gen)
    assert seg.hits > 0 and seg.misses > 0 and seg.cut(tok) is not None      # the second rendering hits


def test_a_tokenizer_whose_special_tokens_take_the_spaces_beside_them_is_encoded_whole(tok: Any) -> None:
    strip = copy.deepcopy(tok)
    strip.add_special_tokens({"additional_special_tokens": [AddedToken("<|tool|>", lstrip=True, rstrip=True)]})
    seg = SegmentTokens(min_chars=16)
    assert seg.cut(strip) is None                           # " <|tool|> " keeps no spaces when encoded whole
    probe = "x " * 40 + " <|tool|> " + "y " * 40
    assert seg.encode(strip, probe, None) == strip.encode(probe, add_special_tokens=False)
    assert seg.hits == seg.misses == 0


def test_the_kept_ids_are_bounded_least_recently_used_first_out(tok: Any) -> None:
    rng = random.Random(2)
    texts = [text(rng, 600) for _ in range(6)]
    sizes = [len(tok.encode(t, add_special_tokens=False)) for t in texts]
    seg = SegmentTokens(max_tokens=sum(sizes[:3]), min_chars=100)
    for t in texts[:3]:
        seg.encode(tok, t, None)
    assert seg.tokens == sum(sizes[:3])
    seg.encode(tok, texts[0], None)                         # the first is now the most recently used
    seg.encode(tok, texts[3], None)                         # out: the second, then the third if need be
    assert seg.tokens <= seg.max_tokens
    hits = seg.hits
    seg.encode(tok, texts[0], None)
    assert seg.hits == hits + 1
    seg.encode(tok, texts[1], None)
    assert seg.hits == hits + 1                             # evicted: encoded again
    too_long = SegmentTokens(max_tokens=10, min_chars=100)
    assert too_long.encode(tok, texts[4], None) == tok.encode(texts[4], add_special_tokens=False)
    assert too_long.tokens == 0


def test_a_served_system_prompt_resent_is_encoded_once(server: ServerThread, client: OpenAI, model_name: str) -> None:
    seg = server.state.tokenizers.segments
    before = seg.min_chars
    seg.min_chars = 64                                      # the shared server's 256-token context
    try:
        system = fresh_system_prompt(12)
        misses, hits = seg.misses, seg.hits
        outs = [client.chat.completions.create(model=model_name, messages=chat(system, q),  # type: ignore[arg-type]
                                               max_tokens=3, temperature=0.0) for q in ("one?", "two?", "one?")]
        assert (seg.misses - misses, seg.hits - hits) == (1, 2)
        counted = http("POST", server.url + "/tokenize", {"model": model_name, "messages": chat(system, "one?")})
        assert outs[0].usage is not None and outs[2].usage is not None
        assert outs[0].usage.prompt_tokens == outs[2].usage.prompt_tokens == counted[1]["count"]
        assert outs[0].choices[0].message.content == outs[2].choices[0].message.content
    finally:
        seg.min_chars = before
