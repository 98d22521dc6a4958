"""Incremental detokenizer: streamed deltas add up to the full decode, multi-byte
characters split across tokens are never emitted half-done, stop strings cut the text."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from actors.detokenizer import IncrementalDetokenizer, find_stop, partial_stop_len
from actors.zoo.zoo import EOS, ensure_model

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


@pytest.mark.parametrize("stops", [(), ("zz",)])
def test_the_last_frame_of_a_request_cut_mid_character_equals_decode(tokenizer, stops):
    """A request that ends (max_tokens, EOS) in the middle of a character: its text, frame by
    frame, adds up to tokenizer.decode(output_ids), replacement characters included."""
    from actors.output_stream import OutputAssembler
    from scheduler.request import Request, RequestStatus
    from scheduler.sampling_params import SamplingParams

    ids = tokenizer.encode("ok 🙂")
    output = ids[:-1]   # the emoji's last byte never comes
    assert tokenizer.decode(output).endswith("\ufffd")
    request = Request("r", "m", tokenizer.encode("Hi"), SamplingParams(max_tokens=len(output), stop=stops))
    assembler = OutputAssembler(tokenizer, request, "cpu")
    texts = []
    for i, token in enumerate(output):
        request.output_token_ids.append(token)
        request.token_times.append(float(i))
        if i == len(output) - 1:
            request.status = RequestStatus.FINISHED_LENGTH
        texts.append(assembler.frame(request)[0].text)
    assert "".join(texts) == tokenizer.decode(output, skip_special_tokens=True)


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


@pytest.mark.parametrize("sizes", [[1] * 64, [5, 3, 7, 64]])
def test_text_made_from_id_frames_cuts_at_the_first_stop_string_and_drops_the_tokens_after(tokenizer, sizes):
    """What the ingress does with a worker's frames of token ids (TextAssembler.fill): the
    text adds up to the decode of the tokens it keeps, which end with the token that completed
    the first stop string; the frame that holds it finishes with "stop", whatever came after."""
    from actors.output_stream import TextAssembler
    from scheduler.messages import OutputFrame

    prompt = tokenizer.encode("Tell me.")
    output = tokenizer.encode("alpha beta gamma delta epsilon zeta", add_special_tokens=False)
    text = TextAssembler(tokenizer, prompt, stops=("delta", "zeta"))
    frames, start = [], 0
    for n in sizes:
        if start >= len(output):
            break
        ids = output[start:start + n]
        start += n
        frame = text.fill(OutputFrame("r", list(ids), "", [float(i) for i in range(len(ids))],
                                      "length" if start >= len(output) else None))
        frames.append(frame)
        if frame.finished:
            break
    kept = [t for f in frames for t in f.token_ids]
    streamed = "".join(f.text for f in frames)
    assert frames[-1].finish_reason == "stop" and all(not f.finished for f in frames[:-1])
    decoded = tokenizer.decode(kept, skip_special_tokens=True)
    assert "delta" in decoded and "delta" not in tokenizer.decode(kept[:-1], skip_special_tokens=True)
    assert streamed == decoded[:decoded.index("delta")] and "delta" not in streamed
    assert len(frames[-1].token_times) == len(frames[-1].token_ids)
