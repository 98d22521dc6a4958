"""Closed-loop multi-turn agents, each on its own model, driven against one Engine.

An agent holds a conversation: a system prompt, then `turns` turns of (user tokens ->
generate `new_tokens` -> think for `think_s`), the context growing by both each turn (the
next request's prompt is the whole conversation so far). It sends its next request only
after the previous one finished and it has thought: a closed loop, as an LLM agent runs.

`run_agents(engine, agents)` is the single-threaded loop of one process: send what is due,
step the engine while it has work, sleep until the next agent wakes otherwise. The same
loop drives one agent on its own engine (alone, time-sliced) and N agents on one engine
(tokenmux), so the arrangements differ only in where the agents' models live.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams


@dataclass(frozen=True)
class AgentSpec:
    model: str
    seed: int
    turns: int = 4
    system_tokens: int = 48
    user_tokens: int = 24
    new_tokens: int = 32
    think_s: float = 0.1
    vocab: int = 2048

    def __post_init__(self) -> None:
        for name in ("turns", "system_tokens", "user_tokens", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"AgentSpec.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.think_s < 0:
            raise ValueError(f"AgentSpec.think_s must be >= 0, got {self.think_s!r}")

    @property
    def max_context(self) -> int:
        return self.system_tokens + self.turns * (self.user_tokens + self.new_tokens)


@dataclass
class TurnRecord:
    arrival: float
    token_times: list[float] = field(default_factory=list)


class Agent:
    def __init__(self, spec: AgentSpec):
        self.spec = spec
        self._rng = random.Random(spec.seed)
        self.context: list[int] = self._tokens(spec.system_tokens)
        self.turns: list[TurnRecord] = []
        self.next_at = 0.0          # when it sends its next request (0: at once)
        self.inflight: str | None = None
        self._output: list[int] = []

    def _tokens(self, n: int) -> list[int]:   # ids above the zoo's special tokens (0..7)
        return [self._rng.randrange(8, self.spec.vocab) for _ in range(n)]

    @property
    def done(self) -> bool:
        return len(self.turns) == self.spec.turns and self.inflight is None

    def due(self, now: float) -> bool:
        return self.inflight is None and len(self.turns) < self.spec.turns and now >= self.next_at

    def request(self, now: float) -> GenerateRequest:
        self.context += self._tokens(self.spec.user_tokens)
        self.inflight = f"{self.spec.model}-turn{len(self.turns)}"
        self.turns.append(TurnRecord(arrival=now))
        self._output = []
        params = SamplingParams(max_tokens=self.spec.new_tokens, temperature=0.0, ignore_eos=True)
        return GenerateRequest(self.inflight, self.spec.model, tuple(self.context), params, arrival_time=now)

    def on_frame(self, frame, now: float) -> None:
        self.turns[-1].token_times += frame.token_times
        self._output += frame.token_ids
        if frame.finished:
            if frame.error:
                raise RuntimeError(f"agent on {self.spec.model}: request failed: {frame.error}")
            self.context += self._output
            self.inflight = None
            self.next_at = now + self.spec.think_s

    def summary(self) -> dict:
        ttft = [t.token_times[0] - t.arrival for t in self.turns if t.token_times]
        gaps = [b - a for t in self.turns for a, b in zip(t.token_times, t.token_times[1:])]
        busy = sum(t.token_times[-1] - t.arrival for t in self.turns if t.token_times)
        tokens = sum(len(t.token_times) for t in self.turns)
        return {"model": self.spec.model, "tokens": tokens, "busy_s": busy, "tokens_per_s": tokens / busy,
                "ttft_s": ttft, "tbt_s": gaps, "start": self.turns[0].arrival,
                "end": max(t.token_times[-1] for t in self.turns if t.token_times)}


def run_agents(engine, agents: list[Agent], clock=time.time, timeout_s: float = 900.0) -> None:
    """Drive the agents to the end of their conversations on `engine`."""
    by_request: dict[str, Agent] = {}
    deadline = clock() + timeout_s
    while not all(a.done for a in agents):
        now = clock()
        if now > deadline:
            raise RuntimeError(f"agents did not finish within {timeout_s:.0f} s")
        for agent in agents:
            if agent.due(now):
                req = agent.request(now)
                engine.add_request(req)
                by_request[req.request_id] = agent
        if engine.has_unfinished():
            frames = engine.step()
            now = clock()
            for frame in frames:
                by_request[frame.request_id].on_frame(frame, now)
        else:
            wake = min((a.next_at for a in agents if not a.done and a.inflight is None), default=now)
            time.sleep(max(0.0, min(wake - now, 0.05)))
