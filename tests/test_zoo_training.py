"""Trained zoo models: new recipes only (every existing fingerprint, and so every cache built
from it, is unchanged), training is deterministic, and the trained models write words."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from actors.zoo import zoo
from actors.zoo.zoo_training import Training

# The fingerprints the zoo's untrained recipes had before trained recipes existed.
FINGERPRINTS = {
    "llama-tiny-a": "0b157470b39f96eb", "llama-tiny-b": "82668eb3a7af0539", "llama-tiny-c": "72c2c9225eb11b40",
    "qwen2-tiny-a": "895890c5b12d59c2", "qwen2-tiny-b": "24072462c8fa6c7f", "qwen2-tiny-c": "275ae0902bd6709c",
    "mistral-tiny-a": "a808f5996744bdfc", "mistral-tiny-b": "77e10f355f38db08",
    "mistral-tiny-c": "1804275572d0981c", "llama-10m": "96ca0a8860d389e7", "llama-100m": "ac4421d37878b3ed",
}
TRAINED = ("llama-prose", "qwen2-prose")


def test_existing_recipes_keep_their_fingerprints():
    assert {name: zoo.ZOO[name].fingerprint() for name in FINGERPRINTS} == FINGERPRINTS


def test_at_least_two_trained_models_of_different_architectures():
    assert {zoo.ZOO[n].arch for n in TRAINED} == {"llama", "qwen2"}
    assert all(zoo.ZOO[n].training is not None for n in TRAINED)


def test_training_is_deterministic(tmp_path):
    recipe = dataclasses.replace(zoo.ZOO["llama-tiny-a"], name="llama-trained-probe",
                                 training=Training(steps=4, batch_size=4, seq_len=32, warmup_steps=2))
    for out in ("one", "two"):
        (tmp_path / out).mkdir()
        zoo._build(recipe, tmp_path / out)
    first, second = ((tmp_path / d / "model.safetensors").read_bytes() for d in ("one", "two"))
    assert first == second
    untrained = tmp_path / "untrained"
    untrained.mkdir()
    zoo._build(dataclasses.replace(recipe, training=None), untrained)
    assert (untrained / "model.safetensors").read_bytes() != first


@pytest.mark.parametrize("name", TRAINED)
def test_trained_models_write_words(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = zoo.ensure_model(name)   # a few CPU minutes the first time, cached after
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    for prompt in ("Dario found", tok.apply_chat_template([{"role": "user", "content": "Tell me something."}],
                                                          add_generation_prompt=True, tokenize=False)):
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=zoo.PAD)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        words = re.findall(r"[A-Za-z]+", text)
        assert len(words) >= 4 and sum(len(w) for w in words) >= 0.7 * len(text.replace(" ", "")), text
