"""IncrementalDetokenizer against full decodes of a real byte-level BPE tokenizer."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.output.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
EOS = "<|endoftext|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, world! Stop here; stop there.",
    "Café crème brûlée, naïve façade, résumé, jalapeño, Ångström, Straße, señor.",
    "東京は日本の首都です。私は猫が好きです。中文分词测试，你好世界。",
    "Emoji: 😀 🎉 🚀 👍🏽 ❤️ 🇫🇷 and more 🤖🤖.",
    "Привет, мир! Ελληνικά γράμματα. नमस्ते दुनिया.",
    "def f(x):\n    return x * 2  # code\n",
]
# Text for generated cases: corpus characters plus some the tokenizer never saw (byte fallback only).
ALPHABET = "abcdefghij STOP.,!\n" + "éèçñüßÅ" + "東京日本猫字中" + "😀🎉🚀🤖" + "Пр" + "🦀ŉ語ǅ"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A ~500-token byte-level BPE trained here, deterministically: its merges cover whole ASCII words
    and some whole multi-byte characters, while rarer characters split into several byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[EOS], show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def feed(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[list[str], str | None]:
    """Feed ids `chunk` at a time until a stop string matches; returns (deltas, stop)."""
    deltas: list[str] = []
    for i in range(0, len(ids), chunk):
        delta, stop = detok.update(ids[i:i + chunk])
        deltas.append(delta)
        if stop is not None:
            return deltas, stop
    return deltas, None


def test_fixture_splits_characters_across_tokens(tokenizer):
    # The tests below are only meaningful if some characters span several tokens.
    ids = encode(tokenizer, "🦀語 東京")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert sum(REPLACEMENT in p for p in pieces) >= 3
    assert tokenizer.decode(ids) == "🦀語 東京"


# -- text equals the full decode --------------------------------------------------------------------

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=ALPHABET, max_size=40), prompt=st.text(alphabet=ALPHABET, max_size=12),
       chunk=st.integers(1, 3))
def test_valid_text_streams_exactly_and_promptly(tokenizer, text, prompt, chunk):
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt), stop=[])
    emitted = ""
    for i in range(0, len(ids), chunk):
        delta, stop = detok.update(ids[i:i + chunk])
        assert stop is None
        assert REPLACEMENT not in delta                     # the text is valid UTF-8 throughout
        emitted += delta
        so_far = tokenizer.decode(ids[:i + chunk])
        if not so_far.endswith(REPLACEMENT):                # nothing held longer than needed
            assert emitted == so_far
        else:
            assert so_far.startswith(emitted)
    assert detok.flush() == ""                              # every character completed
    assert emitted == detok.text == text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_random_token_ids_concatenate_to_the_full_decode(tokenizer, data, skip):
    # Arbitrary ids: lone continuation bytes, truncated characters, special tokens.
    ids_strategy = st.lists(st.integers(0, len(tokenizer) - 1), max_size=30)
    ids, prompt = data.draw(ids_strategy), data.draw(ids_strategy)
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=[], skip_special_tokens=skip)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    emitted = ""
    for token_id in ids:
        delta, _ = detok.update([token_id])
        assert not delta.endswith(REPLACEMENT)              # a trailing U+FFFD waits for its next byte
        assert full[len(emitted):len(emitted) + len(delta)] == delta   # never text that changes later
        emitted += delta
    emitted += detok.flush()
    assert emitted == full == detok.text


def test_flush_emits_a_dangling_partial_character_as_decoded(tokenizer):
    ids = encode(tokenizer, "ok 🦀")
    ids = ids[:-1]                                          # drop the crab's last byte
    detok = IncrementalDetokenizer(tokenizer, [], stop=[])
    deltas, _ = feed(detok, ids)
    assert "".join(deltas) in ("ok", "ok ")                # the space may share the crab's first token
    tail = detok.flush()
    assert tail.endswith(REPLACEMENT)
    assert "".join(deltas) + tail == tokenizer.decode(ids)
    assert detok.flush() == ""                              # idempotent


def test_prompt_ending_mid_character_does_not_leak_into_the_output(tokenizer):
    ids = encode(tokenizer, "🦀🦀")
    assert len(ids) >= 4
    prompt, output = ids[:2], ids[2:]                       # the prompt stops inside the first crab
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=[])
    deltas, _ = feed(detok, output)
    assert "".join(deltas) + detok.flush() == tokenizer.decode(output)


def test_special_tokens_follow_skip_special_tokens(tokenizer):
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids = encode(tokenizer, "Hello") + [eos] + encode(tokenizer, " world")
    for skip, expected in [(True, "Hello world"), (False, f"Hello{EOS} world")]:
        detok = IncrementalDetokenizer(tokenizer, [eos], stop=[], skip_special_tokens=skip)
        deltas, _ = feed(detok, ids)
        assert "".join(deltas) + detok.flush() == expected


def test_decode_window_stays_small(tokenizer):
    """Per-token cost is O(window): no decode call ever sees more than a handful of ids."""
    class Counting:
        def __init__(self, inner):
            self.inner, self.longest = inner, 0

        def decode(self, ids, skip_special_tokens=False):
            self.longest = max(self.longest, len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = Counting(tokenizer)
    ids = encode(tokenizer, "Café 東京 😀 🦀語 the lazy dog. " * 60)
    detok = IncrementalDetokenizer(counting, encode(tokenizer, "prompt " * 50), stop=["never"])
    deltas, _ = feed(detok, ids)
    assert len(ids) > 500
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids)
    assert counting.longest <= 8


# -- stop strings ---------------------------------------------------------------------------------

def _tokens_spanned(tokenizer, ids: list[int], text: str, stop: str) -> int:
    """How many tokens the first occurrence of `stop` touches (by byte offsets)."""
    start = len(text[:text.index(stop)].encode())
    end = start + len(stop.encode())
    touched, offset = 0, 0
    for i in ids:
        n = len(tokenizer.convert_ids_to_tokens(i))        # byte-level: one symbol per byte
        if offset < end and offset + n > start:
            touched += 1
        offset += n
    return touched


@pytest.mark.parametrize("text,stop", [
    ("The quick brown fox jumps over the lazy dog.", "k brow"),
    ("The quick brown fox jumps over the lazy dog.", "x jumps o"),
    ("Here is 🦀語 and more text after it.", "語 an"),
    ("Café crème brûlée, naïve façade", "ème brû"),
])
def test_stop_string_across_tokens_is_cut_and_excluded(tokenizer, text, stop):
    ids = encode(tokenizer, text)
    assert _tokens_spanned(tokenizer, ids, text, stop) >= 2
    detok = IncrementalDetokenizer(tokenizer, [], stop=["zzz", stop])
    deltas, matched = feed(detok, ids)
    expected = text[:text.index(stop)]
    assert matched == stop
    assert "".join(deltas) == expected == detok.text
    # It finished on the token that completed the stop string, not later.
    assert stop in tokenizer.decode(ids[:len(deltas)])
    assert stop not in tokenizer.decode(ids[:len(deltas) - 1])
    assert detok.finished and detok.update(ids[len(deltas):]) == ("", None) and detok.flush() == ""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), chunk=st.integers(1, 3), include=st.booleans())
def test_stop_strings_property(tokenizer, data, chunk, include):
    text = data.draw(st.text(alphabet=ALPHABET, min_size=1, max_size=40))
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start:start + data.draw(st.integers(1, 6))]
    other = data.draw(st.text(alphabet=ALPHABET, min_size=1, max_size=4))
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=[other, stop], include_stop=include)
    deltas, matched = feed(detok, ids, chunk)
    emitted = "".join(deltas) + detok.flush()
    # The stop string whose first occurrence ends first wins; on a tie, the one that starts first.
    end, start, expected_stop = min((text.find(s) + len(s), text.find(s), s) for s in [stop, other] if s in text)
    expected = text[:end] if include else text[:start]      # include_stop_str_in_output keeps it, cuts the rest
    assert matched == expected_stop
    assert emitted == expected == detok.text
    assert emitted.endswith(expected_stop) if include else expected_stop not in emitted


def _ids_of(tokenizer, chars: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(c) for c in chars]         # one token per ASCII char


def test_the_stop_string_that_ends_first_wins(tokenizer):
    # Fed one character at a time, "bc" completes before "abcd" and "xyz" ever could.
    detok = IncrementalDetokenizer(tokenizer, [], stop=["abcd", "xyz", "bc"])
    # "x" waits (it may start "xyz"), then "a" (it may start "abcd"), "ab", and at "c" the match cuts.
    assert feed(detok, _ids_of(tokenizer, "xabcdxyz")) == (["", "x", "", "a"], "bc")
    # Within one token the same rule holds: earliest end, then the earliest start (the longer one).
    ids = encode(tokenizer, "The quick brown fox")
    for stops, text, stop in [(["quick", "ick"], "The ", "quick"), (["own", "brown fox", "bro"], "The quick ", "bro")]:
        detok = IncrementalDetokenizer(tokenizer, [], stop=stops)
        deltas, matched = feed(detok, ids, chunk=len(ids))
        assert (matched, "".join(deltas)) == (stop, text)


def test_possible_stop_prefix_is_held_then_released(tokenizer):
    def ids_of(chars: str) -> list[int]:
        return _ids_of(tokenizer, chars)

    detok = IncrementalDetokenizer(tokenizer, [], stop=["Hello", "abc"])
    assert detok.update(ids_of("xHe")) == ("x", None)          # "He" could start "Hello"
    assert detok.update(ids_of("l")) == ("", None)
    assert detok.update(ids_of("p")) == ("Help", None)         # no longer a stop prefix
    assert detok.update(ids_of("abab")) == ("ab", None)        # the second "ab" could start "abc"
    assert detok.text == "xHelpabab"
    assert detok.update(ids_of("cdef")) == ("", "abc")         # "ababc": cut before the match
    assert detok.text == "xHelpab"

    held = IncrementalDetokenizer(tokenizer, [], stop=["Hello"])
    assert held.update(ids_of("Hell")) == ("", None)
    assert held.flush() == "Hell"                              # finished by length: release it all


def test_stop_string_made_of_multibyte_characters(tokenizer):
    text = "abc 🦀語 def"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["🦀語"])
    deltas, matched = feed(detok, ids)
    assert matched == "🦀語" and "".join(deltas) == "abc "
    assert all(REPLACEMENT not in d for d in deltas)
