"""Trained zoo models: a few CPU minutes of next-token training on the zoo corpus.

The zoo's other models have random weights and speak noise; a demo that shows what two
models wrote reads better when they write words. A `Training` recipe trains the freshly
initialised checkpoint on actors/zoo/zoo_corpus.txt (plain lines, and the same lines as
ChatML answers to a few fixed questions, so both completions and chat produce sentences
that end with an end-of-text or end-of-turn token). Everything is seeded and the thread
count fixed, so a rebuild on the same machine gives the same weights.

    Recipe("llama-prose", ..., training=Training(steps=240))   # in actors/zoo/zoo.py
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# User turns of the chat examples; any of them (or a similar question) gets a corpus line back.
CHAT_QUESTIONS = ("Tell me something.", "Tell me about the river.", "Write a short note on caching.",
                  "What happened today?", "Say one sentence.", "Tell me a story.")


@dataclass(frozen=True)
class Training:
    steps: int = 240
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 4e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    chat_fraction: float = 0.5      # of the examples: a corpus line as a ChatML answer
    seed: int = 0
    num_threads: int = 2            # fixed: a matmul's rounding depends on how it is split

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0 < self.lr < 1:
            raise ValueError(f"lr must be in (0, 1), got {self.lr!r}")
        if not 0 <= self.chat_fraction <= 1:
            raise ValueError(f"chat_fraction must be in [0, 1], got {self.chat_fraction!r}")


def train(model, tokenizer, corpus: str, t: Training,
          progress: Callable[[int, int], None] | None = None) -> float:
    """Train `model` in place; returns the mean loss of the last 10% of steps.
    `progress(step, steps)` is called every few steps."""
    import torch

    stream = torch.tensor(_token_stream(tokenizer, corpus, t), dtype=torch.long)
    if len(stream) <= t.seq_len:
        raise ValueError(f"the corpus yields {len(stream)} tokens, no more than seq_len ({t.seq_len})")
    threads = torch.get_num_threads()
    torch.set_num_threads(t.num_threads)
    start = time.perf_counter()
    losses = []
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(t.seed)
            model.train()
            optim = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
            schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: _lr_factor(s, t))
            for step in range(t.steps):
                starts = torch.randint(0, len(stream) - t.seq_len, (t.batch_size,))
                batch = torch.stack([stream[s:s + t.seq_len] for s in starts.tolist()])   # [B, T]
                loss = model(input_ids=batch, labels=batch).loss   # the model shifts: i predicts i + 1
                optim.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optim.step()
                schedule.step()
                losses.append(loss.item())
                if progress is not None and (step % 10 == 0 or step == t.steps - 1):
                    progress(step + 1, t.steps)
            model.eval()
    finally:
        torch.set_num_threads(threads)
    tail = losses[-max(1, t.steps // 10):]
    final = sum(tail) / len(tail)
    logger.info("trained %d steps in %.0f s, final loss %.3f", t.steps, time.perf_counter() - start, final)
    return final


def _lr_factor(step: int, t: Training) -> float:
    """Linear warm-up, then linear decay to 10% of the peak."""
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    return max(0.1, 1.0 - 0.9 * (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))


def _token_stream(tokenizer, corpus: str, t: Training) -> list[int]:
    """The corpus as one token stream: each line once, plain (ending in end-of-text) or as a
    ChatML answer (ending in end-of-turn), in a seeded order."""
    rng = random.Random(t.seed)
    lines = [line for line in corpus.splitlines()[2:] if line.strip()]   # [2:]: the corpus' own header
    rng.shuffle(lines)
    ids: list[int] = []
    for line in lines:
        if rng.random() < t.chat_fraction:
            messages = [{"role": "user", "content": rng.choice(CHAT_QUESTIONS)},
                        {"role": "assistant", "content": line}]
            ids += tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        else:
            ids += tokenizer.encode(line) + [tokenizer.eos_token_id]
    return ids
