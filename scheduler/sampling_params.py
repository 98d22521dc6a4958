"""How one request is sampled and when it stops."""
from __future__ import annotations

from dataclasses import dataclass

from scheduler.validation import check_int, check_real

# A seed is an int64, as OpenAI's API and torch.Generator.manual_seed take it.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
# Below this a temperature samples like argmax but would overflow logits / temperature
# in float32 (vLLM draws the same line), so it is greedy.
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; validated on construction (bad input -> ValueError).

    temperature == 0 (or below MIN_SAMPLING_TEMPERATURE) means greedy. top_k == 0 means
    "no top-k cut". Numbers must be finite and normal (scheduler/validation.py).
    A seed makes sampling reproducible regardless of which other requests share the batch.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if check_real("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < check_real("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        if self.seed is not None:
            check_int("seed", self.seed, MIN_SEED, MAX_SEED)
        # Accept lists from callers but store tuples so the object stays hashable and frozen.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def to_dict(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "stop": list(self.stop),
            "ignore_eos": self.ignore_eos,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        return cls(**d)
