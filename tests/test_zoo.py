"""The offline zoo builds real, loadable Hugging Face checkpoints, once, deterministically."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from actors.zoo import zoo

REPO = Path(__file__).resolve().parents[1]
TOKENMUX = Path(sys.executable).parent / "tokenmux"   # the env running the tests (a worktree has no .venv)


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("zoo")
    zoo.build_zoo(root, names=zoo.TINY_MODELS)
    return root


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_zoo_has_three_tiny_variants_per_architecture_and_the_benchmark_models():
    for arch in ("llama", "qwen2", "mistral"):
        tiny = [r for r in zoo.ZOO.values() if r.arch == arch and r.name in zoo.TINY_MODELS]
        assert len(tiny) >= 3
        assert len({(r.num_layers, r.num_kv_heads, r.head_dim) for r in tiny}) == len(tiny)
    assert 80e6 <= zoo.ZOO["llama-100m"].num_params <= 120e6
    assert any(r.tie_word_embeddings for r in zoo.ZOO.values() if r.arch == "qwen2")
    assert any(r.rope_scaling for r in zoo.ZOO.values())


@pytest.mark.parametrize("name", zoo.TINY_MODELS)
def test_tiny_model_loads_offline_and_generates(zoo_dir, name):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    path = zoo.ensure_model(name, zoo_dir)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    recipe = zoo.ZOO[name]
    assert type(model).__name__ == json.loads((path / "config.json").read_text())["architectures"][0]
    assert model.num_parameters() == recipe.num_params
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert len(tokenizer) == model.config.vocab_size == zoo.VOCAB_SIZE

    prompt = tokenizer("The quiet garden", return_tensors="pt").input_ids
    out1 = model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    out2 = model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert out1.shape == (1, prompt.shape[1] + 8)
    assert torch.equal(out1, out2)
    assert isinstance(tokenizer.decode(out1[0]), str)


@pytest.mark.parametrize("name", ["llama-tiny-a", "qwen2-tiny-b", "mistral-tiny-c"])
def test_logits_are_peaky_so_greedy_is_not_a_coin_toss(zoo_dir, name):
    model = AutoModelForCausalLM.from_pretrained(zoo.ensure_model(name, zoo_dir))
    ids = torch.arange(10, 60).unsqueeze(0)
    with torch.no_grad():
        probs = model(ids).logits[0].softmax(-1)  # [T, V]
    # A uniform softmax over the vocabulary would give 1/2048 here.
    assert probs.max(-1).values.mean() > 0.2


def test_chat_template_renders_chatml_and_ends_with_assistant_turn(zoo_dir):
    tokenizer = AutoTokenizer.from_pretrained(zoo.ensure_model("qwen2-tiny-a", zoo_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids.count(zoo.IM_START) == 3 and ids.count(zoo.IM_END) == 2
    assert tokenizer.decode(ids) == text


def test_tokenizer_round_trips_any_text_and_knows_its_special_tokens(zoo_dir):
    tokenizer = AutoTokenizer.from_pretrained(zoo.ensure_model("llama-tiny-b", zoo_dir))
    text = "Grüße, 東京! def f(x):\n\treturn x ** 2  # ok"  # bytes outside the corpus too
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens([zoo.BOS, zoo.EOS, zoo.PAD, zoo.IM_START, zoo.IM_END]) == list(zoo.SPECIAL_TOKENS)
    assert tokenizer.eos_token_id == zoo.EOS and tokenizer.pad_token_id == zoo.PAD


def test_generation_config_stops_on_both_eos_and_im_end(zoo_dir):
    gen = GenerationConfig.from_pretrained(zoo.ensure_model("mistral-tiny-a", zoo_dir))
    assert gen.eos_token_id == [zoo.EOS, zoo.IM_END]
    assert gen.do_sample is False


def test_second_build_reuses_the_checkpoint(zoo_dir):
    weights = zoo_dir / "llama-tiny-a" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert zoo.build_zoo(zoo_dir, names=["llama-tiny-a"]) == [zoo_dir / "llama-tiny-a"]
    assert weights.stat().st_mtime_ns == before


def test_interrupted_build_is_redone(tmp_path):
    path = zoo.ensure_model("qwen2-tiny-c", tmp_path)
    good = _sha256(path / "model.safetensors")
    # A build killed midway leaves a dir without its marker and with a torn weight file.
    (path / zoo.MARKER).unlink()
    (path / "model.safetensors").write_bytes(b"torn")
    assert not zoo.is_built("qwen2-tiny-c", tmp_path)
    assert zoo.ensure_model("qwen2-tiny-c", tmp_path) == path
    assert zoo.is_built("qwen2-tiny-c", tmp_path)
    assert _sha256(path / "model.safetensors") == good


def test_concurrent_builders_of_one_model_agree(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    stale = tmp_path / ".llama-tiny-b.killed"  # staging dir of a build that died
    stale.mkdir()
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: zoo.ensure_model("llama-tiny-b", tmp_path), range(3)))
    assert paths == [tmp_path / "llama-tiny-b"] * 3
    assert zoo.is_built("llama-tiny-b", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["llama-tiny-b"]


def test_rebuild_from_scratch_gives_identical_weights(tmp_path, zoo_dir):
    again = zoo.ensure_model("llama-tiny-a", tmp_path)
    assert _sha256(again / "model.safetensors") == _sha256(zoo_dir / "llama-tiny-a" / "model.safetensors")
    assert (again / "tokenizer.json").read_bytes() == (zoo_dir / "llama-tiny-a" / "tokenizer.json").read_bytes()


def test_different_recipes_give_different_weights(zoo_dir):
    a = _sha256(zoo_dir / "mistral-tiny-a" / "model.safetensors")
    b = _sha256(zoo_dir / "mistral-tiny-b" / "model.safetensors")
    assert a != b


def test_list_zoo_reports_what_is_built(tmp_path):
    zoo.ensure_model("mistral-tiny-b", tmp_path)
    rows = {name: (params, arch, built, path) for name, params, arch, built, path in zoo.list_zoo(tmp_path)}
    assert set(rows) == set(zoo.ZOO)
    assert rows["mistral-tiny-b"][1:] == ("MistralForCausalLM", True, tmp_path / "mistral-tiny-b")
    assert rows["llama-100m"][2] is False


def test_zoo_dir_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMUX_ZOO_DIR", str(tmp_path / "elsewhere"))
    assert zoo.default_zoo_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("TOKENMUX_ZOO_DIR")
    assert zoo.default_zoo_dir() == Path.home() / ".cache" / "tokenmux" / "zoo"


def test_unknown_model_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown zoo model 'gpt-5'.*llama-tiny-a"):
        zoo.ensure_model("gpt-5", tmp_path)
    with pytest.raises(ValueError):
        zoo.build_zoo(tmp_path, names=["llama-tiny-a", "nope"])
    assert not (tmp_path / "llama-tiny-a").exists()  # nothing built before the check


def _tokenmux(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(TOKENMUX), *args], capture_output=True, text=True, env=env, timeout=120)


def test_cli_zoo_build_then_list(tmp_path):
    built = _tokenmux("zoo", "build", "--models", "llama-tiny-a", "--dir", str(tmp_path))
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip() == str(tmp_path / "llama-tiny-a")
    assert zoo.is_built("llama-tiny-a", tmp_path)

    listed = _tokenmux("zoo", "list", "--dir", str(tmp_path), "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {r["name"]: r for r in map(json.loads, listed.stdout.splitlines())}
    assert rows["llama-tiny-a"]["built"] is True and rows["llama-tiny-b"]["built"] is False
    assert rows["llama-100m"]["params"] == zoo.ZOO["llama-100m"].num_params

    table = _tokenmux("zoo", "list", "--dir", str(tmp_path))
    assert table.returncode == 0
    line = next(l for l in table.stdout.splitlines() if l.startswith("llama-tiny-a "))
    assert "yes" in line and "LlamaForCausalLM" in line


def test_cli_bad_model_name_is_one_error_line_and_exit_2(tmp_path):
    result = _tokenmux("zoo", "build", "--models", "llama-tiny-a,nope", "--dir", str(tmp_path))
    assert result.returncode == 2
    errors = [l for l in result.stderr.splitlines() if l.startswith("tokenmux: error:")]
    assert len(errors) == 1 and "'nope'" in errors[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "llama-tiny-a").exists()


def test_cli_without_a_subcommand_shows_usage():
    result = _tokenmux()
    assert result.returncode == 2
    assert "usage: tokenmux" in result.stderr


def test_cli_module_entry_matches_console_script():
    result = subprocess.run([sys.executable, "-m", "deploy.cli.main", "zoo", "list", "--json"],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == len(zoo.ZOO)


@pytest.mark.parametrize("name", ["llama-tiny-a", "qwen2-tiny-a", "mistral-tiny-a"])
def test_transformers_tokenizer_equals_the_raw_tokenizer_json(zoo_dir, name):
    # transformers rebuilds qwen2 tokenizers from vocab+merges; the ids must not change.
    from tokenizers import Tokenizer

    path = zoo.ensure_model(name, zoo_dir)
    hf = AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = "Pavel counted 720 boxes;\n\n  that's 751 <|im_end|> Grüße 東京 <|endoftext|>"
    assert hf(text, add_special_tokens=False).input_ids == raw.encode(text, add_special_tokens=False).ids
    assert len(hf) == raw.get_vocab_size() == zoo.VOCAB_SIZE
