"""Incremental detokenizer: streamed deltas add up to the full decode, multi-byte
characters split across tokens are never emitted half-done, stop strings cut the text."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from actors.detokenizer import IncrementalDetokenizer, find_stop, partial_stop_len
from load_tests.zoo import EOS, ensure_model

TEXTS = [
    "A cache is fast because it is small and close to the processor.",
    "if x > 0 and y > 0:\n    area = x * y\nelse:\n    area = 0",
    "Café crème, naïve façade — 日本語のテキスト 🙂👍🏽 done.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_model("llama-tiny-a"))


def _stream(tokenizer, prompt_ids, output_ids, chunk_sizes):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas, i = [], 0
    for n in chunk_sizes:
        deltas.append(detok.step(output_ids[i:i + n]))
        i += n
    deltas.append(detok.finish())
    return detok, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Tell me something.")
    output = tokenizer.encode(text)
    rng = random.Random(0)
    for sizes in ([1] * len(output), [rng.randint(1, 4) for _ in output]):
        detok, deltas = _stream(tokenizer, prompt, output, sizes)
        assert "".join(deltas) == detok.text == tokenizer.decode(output) == text


def test_split_utf8_characters_are_held_until_complete(tokenizer):
    text = "🙂é日"
    output = tokenizer.encode(text)
    # The premise: some token on its own is an incomplete character.
    assert any("\ufffd" in tokenizer.decode([t]) for t in output)
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.step([t]) for t in output]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert "" in deltas  # something was held back while its bytes were incomplete


def test_finish_flushes_an_incomplete_tail(tokenizer):
    output = tokenizer.encode("ok 🙂")
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = detok.step(output[:-1])
    assert "\ufffd" not in streamed and streamed.startswith("ok")
    assert detok.finish() == tokenizer.decode(output[:-1])[len(streamed):]


def test_special_tokens_are_skipped(tokenizer):
    output = tokenizer.encode("The end.") + [EOS]
    _, deltas = _stream(tokenizer, [], output, [1] * len(output))
    assert "".join(deltas) == "The end."


def test_find_stop_gives_the_earliest_cut():
    text = "alpha beta STOP gamma END"
    assert find_stop(text, ["END", "STOP"]) == text.index("STOP")
    assert find_stop(text, ["zeta"]) is None
    assert find_stop(text, []) is None
    assert find_stop(text, ["a"], start=text.index("gamma")) == text.index("gamma") + 1
    assert text[:find_stop(text, ["STOP"])] == "alpha beta "


def test_partial_stop_len_holds_back_possible_stop_prefixes():
    assert partial_stop_len("hello <|im", ["<|im_end|>"]) == 4
    assert partial_stop_len("hello", ["<|im_end|>"]) == 0
    assert partial_stop_len("abc", ["bcd", "cx"]) == 2
    assert partial_stop_len("", ["x"]) == 0


class _SlowTokenizer:
    """A tokenizer without a `tokenizers` backend: the detokenizer's window path."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.mark.parametrize("text", TEXTS)
def test_window_path_and_streaming_decoder_emit_the_same_deltas(tokenizer, text):
    prompt, output = tokenizer.encode("Tell me something."), tokenizer.encode(text)
    sizes = [random.Random(1).randint(1, 3) for _ in output]
    fast_detok, fast = _stream(tokenizer, prompt, output, sizes)
    slow_detok, slow = _stream(_SlowTokenizer(tokenizer), prompt, output, sizes)
    assert fast_detok._stream is not None and slow_detok._stream is None
    assert fast == slow and slow_detok.text == text
