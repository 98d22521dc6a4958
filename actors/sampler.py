"""Turns each request's last-token logits into its next token.

Greedy (temperature 0) is an argmax. Otherwise logits are divided by the temperature, cut
to the top-k, then to the top-p nucleus (the smallest set of most likely tokens whose
probability reaches top_p), and one token is drawn by inverse CDF from a single uniform
number. That number comes from the request's own torch.Generator when it has a seed, so a
seeded request draws the same tokens whatever other requests share its batch.

A row whose logits are not finite (NaN, +inf: a numeric blow-up of that one sequence), or
are not once divided by its temperature, gets INVALID_TOKEN instead of a token, so the
engine fails that request alone; every other row is sampled as usual (and every seeded
generator still draws once).
"""
from __future__ import annotations

import torch

from scheduler.sampling_params import SamplingParams


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator a seeded request needs (None when unseeded)."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


INVALID_TOKEN = -1


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """# logits [B, V] -> B token ids (INVALID_TOKEN for a row whose logits are not finite)."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {list(logits.shape)}")
        if not len(params) == len(generators) == logits.shape[0]:
            raise ValueError(
                f"need one SamplingParams and one generator per row: {logits.shape[0]} rows, "
                f"{len(params)} params, {len(generators)} generators"
            )
        tokens = logits.argmax(dim=-1)   # [B]; argmax picks a NaN or +inf when the row has one
        bad = ~logits.gather(1, tokens[:, None]).squeeze(1).isfinite()   # [B], B values read, not B * V
        tokens = tokens.masked_fill(bad, INVALID_TOKEN)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens.tolist()
        # A bad row is sampled from zeros (and its token dropped), so every generator draws once.
        clean = logits[rows].float().masked_fill(bad[rows].unsqueeze(1), 0.0)
        sampled = self._sample_rows(clean, [params[i] for i in rows], [generators[i] for i in rows])
        tokens = tokens.tolist()
        for i, t in zip(rows, sampled):
            if tokens[i] != INVALID_TOKEN:
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
        bad = ~values[:, 0].isfinite()   # [R] NaN/inf once scaled: drawn from zeros, reported INVALID
        values = values.masked_fill(bad[:, None], 0.0)
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
        return order.gather(1, pick).squeeze(1).masked_fill(bad, INVALID_TOKEN).tolist()


def skip_draws(generator: torch.Generator | None, num_tokens: int) -> None:
    """Advance a request's generator past the draws of `num_tokens` sampled tokens (one each, as
    `_uniform` makes them), so a request continued elsewhere samples on from where it was."""
    if generator is None:
        return
    for _ in range(num_tokens):
        _uniform(generator)


def _uniform(generator: torch.Generator | None) -> float:
    """One draw in [0, 1) from the request's generator, or the global one when unseeded."""
    if generator is None:
        return torch.rand(1).item()
    return torch.rand(1, generator=generator, device=generator.device).item()
