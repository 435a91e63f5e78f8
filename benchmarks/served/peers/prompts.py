"""The prompts of `bench peers`: texts of random words with exact token counts, built from a seed before any
server starts, so that every system gets the same requests in the same order.

Each part of a round's prompts draws from a generator of its own (seeded by round seed and part name): the
prompts of one workload do not change when another is added or resized.

A long system prompt is cut at its end until the whole chat prompt (template included) leaves room for the
output in the model's context, less `SLACK` tokens (llama.cpp adds a BOS token, and each server renders the
chat template itself): an "8,192-token" system prompt on a model of 8,192 positions is ~8,040 tokens.
`Workload.system_tokens` says how long each one came out.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

WORDS = ("river mountain garden window lantern harbor meadow castle forest silver copper engine signal "
         "market bridge canyon desert island valley winter summer autumn spring letter number puzzle "
         "theory method system network pattern history science music painting language travel").split()
SLACK = 16

# The workloads' shapes (prompt tokens, output tokens, concurrency); how many requests: `Sizes`.
THROUGHPUT_IN, THROUGHPUT_OUT = 128, 128
SINGLE_IN, SINGLE_OUT = 128, 128
SHARED_SYSTEM, SHARED_QUESTION, SHARED_OUT, SHARED_CONCURRENCY = 1024, 32, 64, 8
LONG_SYSTEM = {"long3k": 3072, "long8k": 8192}
LONG_QUESTION, LONG_OUT, LONG_CONCURRENCY = 64, 64, 16
MANY_SYSTEM, MANY_QUESTION, MANY_OUT, MANY_CONCURRENCY = 512, 64, 64, 8
SESSION_SYSTEM, SESSION_TURN, SESSION_OUT = 256, 64, 64


@dataclass(frozen=True)
class Sizes:
    """How many requests each workload sends. The prompt lengths never change with it: they are the point."""
    throughput: int = 64
    single: int = 3
    shared: int = 32            # the 1,024-token shared prefix; each pass of the contention run too
    long: int = 48              # each of long3k and long8k
    systems: int = 16           # many distinct system prompts ...
    users: int = 4              # ... each asked by this many users
    sessions: int = 8           # chat sessions, all at once ...
    turns: int = 6              # ... of this many turns each, the whole history resent every turn


SMOKE = Sizes(throughput=8, single=1, shared=8, long=4, systems=4, users=2, sessions=2, turns=3)


@dataclass
class SharedPrompt:
    """One system prompt and the distinct questions asked after it."""
    system: str
    questions: list[str]


@dataclass
class Session:
    system: str
    turns: list[str]                        # the user's messages; the answers come from the server


@dataclass
class Workload:
    throughput: list[str]
    single: list[str]
    shared: SharedPrompt
    loadgen_seed: int
    long: dict[str, SharedPrompt]           # "long3k", "long8k"
    many: list[tuple[str, str]]             # (system prompt, question) in arrival order
    sessions: list[Session]
    contention: tuple[SharedPrompt, SharedPrompt]       # the quiet pass's, the busy pass's
    system_tokens: dict[str, int] = field(default_factory=dict)


def text_of_tokens(tokenizer: Any, n: int, rng: random.Random) -> str:
    """A text of random words that the model's tokenizer encodes to exactly `n` tokens."""
    words: list[str] = []
    have = 0
    while have < n + 8:                     # a word is one token or more: one draw is nearly always enough
        words += rng.choices(WORDS, k=max(16, n + 8 - have))
        have = len(tokenizer.encode(" ".join(words), add_special_tokens=False))
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[:n]
    text = tokenizer.decode(ids)
    while len(tokenizer.encode(text, add_special_tokens=False)) > n:
        text = text[:-1]
    return text


def chat_len(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    """Tokens of the chat prompt as rendered by the model's template, generation prompt included."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(ids if isinstance(ids, list) else ids["input_ids"])


def fit_system(tokenizer: Any, system: str, questions: list[str], budget: int) -> str:
    """`system`, cut at its end until every [system, question] chat prompt has at most `budget` tokens."""
    for _ in range(32):
        over = max(chat_len(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q}])
                   for q in questions) - budget
        if over <= 0:
            return system
        ids = tokenizer.encode(system, add_special_tokens=False)
        if over >= len(ids):
            raise ValueError(f"the questions alone leave no room for a system prompt in {budget} tokens")
        system = tokenizer.decode(ids[:len(ids) - over])
    raise RuntimeError("the system prompt did not settle under the budget")


def shared_prompt(tokenizer: Any, rng: random.Random, system_len: int, question_len: int, n: int) -> SharedPrompt:
    return SharedPrompt(text_of_tokens(tokenizer, system_len, rng),
                        [text_of_tokens(tokenizer, question_len, rng) for _ in range(n)])


def workload(tokenizer: Any, seed: int, context: int, sizes: Sizes = Sizes()) -> Workload:
    """Every prompt of one round. `context`: the model's positions (every server is given all of them)."""
    def rng(part: str) -> random.Random:
        return random.Random(f"{seed}:{part}")

    r = rng("throughput")
    throughput = [text_of_tokens(tokenizer, THROUGHPUT_IN, r) for _ in range(sizes.throughput)]
    r = rng("single")
    single = [text_of_tokens(tokenizer, SINGLE_IN, r) for _ in range(sizes.single)]
    shared = shared_prompt(tokenizer, rng("shared"), SHARED_SYSTEM, SHARED_QUESTION, sizes.shared)
    long: dict[str, SharedPrompt] = {}
    for key, n in LONG_SYSTEM.items():
        p = shared_prompt(tokenizer, rng(key), n, LONG_QUESTION, sizes.long)
        p.system = fit_system(tokenizer, p.system, p.questions, context - LONG_OUT - SLACK)
        long[key] = p
    r = rng("many")
    systems = [text_of_tokens(tokenizer, MANY_SYSTEM, r) for _ in range(sizes.systems)]
    many = [(s, text_of_tokens(tokenizer, MANY_QUESTION, r)) for s in systems for _ in range(sizes.users)]
    r.shuffle(many)                         # a system prompt's users arrive spread over the run
    r = rng("sessions")
    sessions = [Session(text_of_tokens(tokenizer, SESSION_SYSTEM, r),
                        [text_of_tokens(tokenizer, SESSION_TURN, r) for _ in range(sizes.turns)])
                for _ in range(sizes.sessions)]
    contention = (shared_prompt(tokenizer, rng("quiet"), SHARED_SYSTEM, SHARED_QUESTION, sizes.shared),
                  shared_prompt(tokenizer, rng("busy"), SHARED_SYSTEM, SHARED_QUESTION, sizes.shared))
    w = Workload(throughput, single, shared, seed, long, many, sessions, contention)
    w.system_tokens = {key: len(tokenizer.encode(p.system, add_special_tokens=False)) for key, p in long.items()}
    return w
