"""An offline zoo of real Hugging Face checkpoints, made deterministically from seeds.

tokenmux is tested and benchmarked without a model hub. Each recipe below becomes an
ordinary checkpoint directory (config.json, generation_config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a ChatML chat template) that
`AutoModelForCausalLM.from_pretrained(path)` and `AutoTokenizer.from_pretrained(path)`
load with HF_HUB_OFFLINE=1. The weights are random (seeded) and float32, so the models
speak nonsense, but every code path of a real Llama / Qwen2 / Mistral / Mixtral checkpoint
is exercised: GQA and MQA, head_dim != hidden/heads, q/k/v bias, tied embeddings, RoPE
scaling, several EOS ids, sparse mixture-of-experts layers.

The tokenizer is a byte-level BPE trained here, in well under a second, on
actors/zoo/zoo_corpus.txt (text written for tokenmux) and shared by all zoo models.

Where models live: $TOKENMUX_ZOO_DIR, else ~/.cache/tokenmux/zoo. A model directory is
complete once its marker file (written last) exists and matches the recipe; an
interrupted or outdated build is redone, a complete one is reused. Rebuilding from
scratch gives byte-identical model.safetensors.

    ensure_model("llama-tiny-a")      # -> Path, builds it on first use
    build_zoo(names=["llama-100m"])   # the benchmark model (~100M params, ~400 MB)
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from actors.zoo.zoo_training import Training, train

logger = logging.getLogger(__name__)

CORPUS_PATH = Path(__file__).with_name("zoo_corpus.txt")
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<|bos|>", "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
BOS, EOS, PAD, IM_START, IM_END = range(len(SPECIAL_TOKENS))  # ids: specials come first
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MARKER = ".tokenmux-zoo.json"
ZOO_FORMAT = 2  # bump when the build changes in a way recipes do not show
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                  "mixtral": "MixtralForCausalLM"}


@dataclass(frozen=True)
class Recipe:
    name: str
    arch: str                       # "llama" | "qwen2" | "mistral" | "mixtral"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    seed: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False    # llama only; qwen2 always has q/k/v bias, mistral never
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    sliding_window: int | None = None
    max_position_embeddings: int = 2048
    # Large enough that logits are peaky: greedy argmax is then decided by the model,
    # not by float rounding, and engines can be compared with HF token for token.
    initializer_range: float = 0.08
    # The final RMSNorm weight is set so that logits have about this std (peaky softmax).
    logit_std: float = 5.0
    default: bool = True            # built by `build_zoo()` without names
    # None: random weights (speak noise). A Training: trained on the corpus (actors/zoo/zoo_training.py).
    training: Training | None = None
    # A sparse MoE (mixtral): (experts, experts per token); intermediate_size is one expert's.
    experts: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.arch not in _ARCHITECTURES:
            raise ValueError(f"recipe {self.name}: arch must be one of {sorted(_ARCHITECTURES)}, got {self.arch!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"recipe {self.name}: num_heads must be a multiple of num_kv_heads")
        if self.attention_bias and self.arch != "llama":
            raise ValueError(f"recipe {self.name}: attention_bias is only configurable for llama")
        if (self.arch == "mixtral") != (self.experts is not None):
            raise ValueError(f"recipe {self.name}: experts go with arch mixtral, and only with it")

    @property
    def num_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = q + 2 * kv if self.arch == "qwen2" else (q + 2 * kv + h if self.attention_bias else 0)
        attention = h * q + 2 * h * kv + q * h + bias
        mlp = 3 * h * self.intermediate_size
        if self.experts is not None:   # every expert's MLP and the router
            mlp = self.experts[0] * mlp + self.experts[0] * h
        layer = attention + mlp + 2 * h  # two RMSNorm weights
        embeddings = VOCAB_SIZE * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeddings + h  # + final norm

    def fingerprint(self) -> str:
        recipe = asdict(self)
        for key in ("training", "experts"):   # recipes without them keep the fingerprints their caches were built with
            if recipe[key] is None:
                del recipe[key]
        data = json.dumps({"recipe": recipe, "format": ZOO_FORMAT, "corpus": _corpus_digest()}, sort_keys=True)
        return hashlib.sha256(data.encode()).hexdigest()[:16]


def _recipes(*recipes: Recipe) -> dict[str, Recipe]:
    return {r.name: r for r in recipes}


ZOO: dict[str, Recipe] = _recipes(
    # ~1M params each; shapes differ so slabs of several KV shapes coexist in one pool.
    Recipe("llama-tiny-a", "llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=4,
           head_dim=32, intermediate_size=352, seed=101),
    Recipe("llama-tiny-b", "llama", num_layers=3, hidden_size=128, num_heads=8, num_kv_heads=2,
           head_dim=16, intermediate_size=256, seed=102, rope_theta=500000.0),
    Recipe("llama-tiny-c", "llama", num_layers=4, hidden_size=96, num_heads=4, num_kv_heads=1,
           head_dim=32, intermediate_size=256, seed=103, attention_bias=True, rope_theta=500000.0,
           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    Recipe("qwen2-tiny-a", "qwen2", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
           head_dim=32, intermediate_size=320, seed=201, tie_word_embeddings=True, rope_theta=1000000.0),
    Recipe("qwen2-tiny-b", "qwen2", num_layers=3, hidden_size=128, num_heads=8, num_kv_heads=4,
           head_dim=16, intermediate_size=256, seed=202,
           rope_scaling={"rope_type": "linear", "factor": 2.0}),
    Recipe("qwen2-tiny-c", "qwen2", num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=1,
           head_dim=16, intermediate_size=192, seed=203, tie_word_embeddings=True),
    Recipe("mistral-tiny-a", "mistral", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
           head_dim=32, intermediate_size=384, seed=301),
    Recipe("mistral-tiny-b", "mistral", num_layers=3, hidden_size=128, num_heads=8, num_kv_heads=2,
           head_dim=32, intermediate_size=256, seed=302, rope_theta=1000000.0),
    # Declares a sliding window (as Mistral 7B v0.1 does), but as long as the context, so it never bites.
    Recipe("mistral-tiny-c", "mistral", num_layers=4, hidden_size=96, num_heads=6, num_kv_heads=3,
           head_dim=16, intermediate_size=256, seed=303, sliding_window=4096, max_position_embeddings=4096),
    Recipe("llama-10m", "llama", num_layers=6, hidden_size=384, num_heads=6, num_kv_heads=2,
           head_dim=64, intermediate_size=1024, seed=401, initializer_range=0.05),
    Recipe("llama-100m", "llama", num_layers=14, hidden_size=768, num_heads=12, num_kv_heads=4,
           head_dim=64, intermediate_size=2304, seed=501, initializer_range=0.05, max_position_embeddings=4096),
    # Trained for a few CPU minutes, so they write words: the embedded default of `tokenmux serve` and the demo.
    Recipe("llama-prose", "llama", num_layers=4, hidden_size=192, num_heads=6, num_kv_heads=2,
           head_dim=32, intermediate_size=512, seed=601, initializer_range=0.02, training=Training(seed=1)),
    Recipe("qwen2-prose", "qwen2", num_layers=4, hidden_size=192, num_heads=6, num_kv_heads=3,
           head_dim=32, intermediate_size=448, seed=602, initializer_range=0.02, tie_word_embeddings=True,
           training=Training(seed=2)),
    # A sparse MoE: 4 experts of which each token runs 2 (the other MoE family, Qwen3-MoE, is in the tests).
    Recipe("mixtral-tiny-a", "mixtral", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
           head_dim=32, intermediate_size=192, seed=701, experts=(4, 2)),
)
TINY_MODELS = tuple(name for name in ZOO if "-tiny-" in name)


def default_zoo_dir() -> Path:
    return Path(os.environ.get("TOKENMUX_ZOO_DIR") or Path.home() / ".cache" / "tokenmux" / "zoo").expanduser()


def recipe(name: str) -> Recipe:
    if name not in ZOO:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(ZOO)}")
    return ZOO[name]


def is_built(name: str, zoo_dir: str | Path | None = None) -> bool:
    marker = Path(zoo_dir or default_zoo_dir()) / name / MARKER
    try:
        return json.loads(marker.read_text()).get("fingerprint") == recipe(name).fingerprint()
    except (OSError, ValueError):
        return False


def ensure_model(name: str, zoo_dir: str | Path | None = None,
                 progress: Callable[[int, int], None] | None = None) -> Path:
    """The model's directory, built first if it is missing, incomplete or outdated.
    `progress(step, steps)` follows the training of a trained recipe."""
    r = recipe(name)
    root = Path(zoo_dir or default_zoo_dir()).expanduser()
    target = root / name
    if is_built(name, root):
        return target
    root.mkdir(parents=True, exist_ok=True)
    # One builder at a time per model, across processes (Ray workers, pytest workers).
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(name, root):
            return target
        for stale in root.glob(f".{name}.*"):  # staging dirs of builds that were killed
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        staging.chmod(0o755)
        try:
            _build(r, staging, progress)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("built zoo model %s (%d params) in %s", name, r.num_params, target)
    return target


def build_zoo(
    zoo_dir: str | Path | None = None,
    names: Iterable[str] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[Path]:
    """Ensure the named models (default: every recipe with default=True); returns their dirs.

    `progress(name, index, total)` is called before each model is ensured.
    """
    selected = [n for n, r in ZOO.items() if r.default] if names is None else list(names)
    for n in selected:
        recipe(n)  # fail before building anything
    paths = []
    for i, n in enumerate(selected):
        if progress is not None:
            progress(n, i, len(selected))
        paths.append(ensure_model(n, zoo_dir))
    return paths


def list_zoo(zoo_dir: str | Path | None = None) -> list[tuple[str, int, str, bool, Path]]:
    """(name, params, architecture, built, path) for every recipe."""
    root = Path(zoo_dir or default_zoo_dir()).expanduser()
    return [(n, r.num_params, _ARCHITECTURES[r.arch], is_built(n, root), root / n) for n, r in ZOO.items()]


# ---- building -------------------------------------------------------------------------


@functools.cache
def _corpus_digest() -> str:
    return hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest()[:16]


@functools.cache
def _tokenizer_json() -> str:
    """The shared byte-level BPE, trained on the shipped corpus (deterministic).

    Its pipeline (NFC, Qwen2's split regex, byte-level without its own regex) is the one
    transformers rebuilds for every qwen2 checkpoint from vocab and merges, so the
    tokenizer behaves the same whichever architecture's checkpoint it ships in.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS_PATH.read_text().splitlines(), trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"{CORPUS_PATH} yields {tok.get_vocab_size()} tokens, need {VOCAB_SIZE}; add text")
    return tok.to_str()


def _hf_config(r: Recipe):
    from transformers import AutoConfig

    rope = {"rope_type": "default", "rope_theta": r.rope_theta}
    if r.rope_scaling is not None:
        rope = {**r.rope_scaling, "rope_theta": r.rope_theta}
    kwargs = dict(
        architectures=[_ARCHITECTURES[r.arch]],
        vocab_size=VOCAB_SIZE,
        hidden_size=r.hidden_size,
        intermediate_size=r.intermediate_size,
        num_hidden_layers=r.num_layers,
        num_attention_heads=r.num_heads,
        num_key_value_heads=r.num_kv_heads,
        head_dim=r.head_dim,
        max_position_embeddings=r.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters=rope,
        tie_word_embeddings=r.tie_word_embeddings,
        initializer_range=r.initializer_range,
        bos_token_id=BOS,
        eos_token_id=[EOS, IM_END],
        pad_token_id=PAD,
        dtype="float32",
    )
    if r.arch == "llama":
        kwargs["attention_bias"] = r.attention_bias
    if r.arch in ("mistral", "mixtral"):
        kwargs["sliding_window"] = r.sliding_window
    if r.experts is not None:
        kwargs.update(num_local_experts=r.experts[0], num_experts_per_tok=r.experts[1])
    if r.arch == "qwen2" and r.sliding_window is not None:
        kwargs.update(use_sliding_window=True, sliding_window=r.sliding_window, max_window_layers=0)
    return AutoConfig.for_model(r.arch, **kwargs)


def _build(r: Recipe, out: Path, progress: Callable[[int, int], None] | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _hf_config(r)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(r.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokenizer = _tokenizer(r)
    if r.training is None:
        with torch.no_grad():  # normed hidden has rms 1, so logit std = norm * sqrt(hidden) * init
            model.model.norm.weight.fill_(r.logit_std / (r.hidden_size**0.5 * r.initializer_range))
    else:
        train(model, tokenizer, CORPUS_PATH.read_text(), r.training, progress)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS, eos_token_id=[EOS, IM_END], pad_token_id=PAD, do_sample=False
    )
    with _quiet_transformers():
        model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for file in out.iterdir():
        file.chmod(0o644)  # save_pretrained may leave 0600 files behind
    marker = {"name": r.name, "fingerprint": r.fingerprint(), "num_params": r.num_params}
    (out / MARKER).write_text(json.dumps(marker, indent=1) + "\n")  # last: the dir is complete


def _tokenizer(r: Recipe):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token=SPECIAL_TOKENS[BOS],
        eos_token=SPECIAL_TOKENS[EOS],
        pad_token=SPECIAL_TOKENS[PAD],
        additional_special_tokens=[SPECIAL_TOKENS[IM_START], SPECIAL_TOKENS[IM_END]],
        chat_template=CHAT_TEMPLATE,
        model_max_length=r.max_position_embeddings,
    )


@contextlib.contextmanager
def _quiet_transformers():
    """No per-shard progress bars from transformers: callers show their own progress."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
