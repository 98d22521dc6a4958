"""Turns each request's last-token logits into its next token.

Greedy (temperature 0) is an argmax. Otherwise logits are divided by the temperature, cut
to the top-k, then to the top-p nucleus (the smallest set of most likely tokens whose
probability reaches top_p), and one token is drawn by inverse CDF from a single uniform
number. That number comes from the request's own torch.Generator when it has a seed, so a
seeded request draws the same tokens whatever other requests share its batch.
"""
from __future__ import annotations

import torch

from scheduler.sampling_params import SamplingParams


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator a seeded request needs (None when unseeded)."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """# logits [B, V] -> B token ids."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {list(logits.shape)}")
        if not len(params) == len(generators) == logits.shape[0]:
            raise ValueError(
                f"need one SamplingParams and one generator per row: {logits.shape[0]} rows, "
                f"{len(params)} params, {len(generators)} generators"
            )
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens.tolist()
        sampled = self._sample_rows(logits[rows].float(), [params[i] for i in rows], [generators[i] for i in rows])
        tokens = tokens.tolist()
        for i, t in zip(rows, sampled):
            tokens[i] = t
        return tokens

    @staticmethod
    def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
        device, V = logits.device, logits.shape[1]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        # Sorted descending; stable so equal logits keep a fixed order.
        values, order = torch.sort(logits / temperature[:, None], dim=-1, descending=True, stable=True)  # [R, V]
        rank = torch.arange(V, device=device)
        values = values.masked_fill(rank >= top_k[:, None], float("-inf"))
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)  # the top token always stays
        cdf = probs.cumsum(dim=-1)  # [R, V]
        u = torch.tensor([_uniform(g) for g in generators], device=device, dtype=cdf.dtype)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)  # [R, 1]
        num_kept = (probs > 0).sum(dim=-1, keepdim=True)
        pick = torch.minimum(pick, num_kept - 1)  # rounding must never land past the kept tokens
        return order.gather(1, pick).squeeze(1).tolist()


def _uniform(generator: torch.Generator | None) -> float:
    """One draw in [0, 1) from the request's generator, or the global one when unseeded."""
    if generator is None:
        return torch.rand(1).item()
    return torch.rand(1, generator=generator, device=generator.device).item()
