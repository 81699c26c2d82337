"""Sampling parameters and next-token selection. Pure torch, no model."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from chatd.config import GenerationSettings

# Below this a temperature is treated as 0 (greedy). Such a temperature already puts all but ~e^-1000
# of the probability mass on the best token whenever it leads by 1 logit, so sampling at it is greedy
# in all but name, and the division by it is where overflow begins.
MIN_SAMPLING_TEMPERATURE = 1e-3


class SamplingError(ValueError):
    """The logits of one row cannot be sampled (they hold NaN or inf): that row's generation fails."""


class Overrides(Protocol):
    """A request's optional sampling fields (the wire's GenerationParams has this shape); None = default."""

    @property
    def max_tokens(self) -> int | None: ...
    @property
    def temperature(self) -> float | None: ...
    @property
    def top_p(self) -> float | None: ...
    @property
    def top_k(self) -> int | None: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def stop(self) -> Sequence[str]: ...


@dataclass(frozen=True)
class SamplingParams:
    """Fully resolved parameters of one generation."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def resolve(cls, p: Overrides | None, defaults: GenerationSettings) -> SamplingParams:
        """Request overrides on top of the server's defaults; a missing seed gets a random one, and a
        temperature below MIN_SAMPLING_TEMPERATURE becomes 0 (greedy)."""
        def pick(value: float | None, default: float) -> float:
            return default if value is None else value

        temperature = pick(p.temperature if p else None, defaults.temperature)
        return cls(
            max_tokens=int(pick(p.max_tokens if p else None, defaults.max_tokens)),
            temperature=0.0 if temperature < MIN_SAMPLING_TEMPERATURE else temperature,
            top_p=pick(p.top_p if p else None, defaults.top_p),
            top_k=int(pick(p.top_k if p else None, defaults.top_k)),
            seed=p.seed if p is not None and p.seed is not None else secrets.randbits(63),
            stop=tuple(p.stop) if p else (),
        )


def make_generator(params: SamplingParams) -> torch.Generator:
    """A CPU generator seeded from the params, so a seeded request is reproducible."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(params.seed)
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token id from ``logits`` ``[vocab]`` (any float dtype, any device).

    Greedy when temperature is 0 (ties go to the lowest id, as torch.argmax does). Otherwise
    temperature scaling, then top-k, then top-p (nucleus, keeping at least one token), then a draw
    from ``generator``. Any positive temperature is safe: the scores are shifted so the best one is 0
    before dividing, so they can only underflow to -inf, never overflow.

    Raises SamplingError when the logits are not all finite; nothing else is changed then.
    """
    if params.greedy:
        return int(torch.argmax(logits).item())
    scores = logits.float().cpu()  # [vocab] fp32
    if not bool(torch.isfinite(scores).all()):
        raise SamplingError("the model produced non-finite logits")
    # Candidates best first: the top-k when it applies (a partial selection, far cheaper than sorting
    # the whole vocabulary), else every token.
    if 0 < params.top_k < scores.numel():
        values, ids = torch.topk(scores, params.top_k)
    else:
        values, ids = torch.sort(scores, descending=True)
    probs = torch.softmax((values - values[0]) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        # Drop a candidate when the mass before it already reaches top_p; the first always stays.
        kept = int(((probs.cumsum(dim=-1) - probs) < params.top_p).sum())
        probs = probs[:kept]
    choice = int(torch.multinomial(probs, 1, generator=generator).item())
    return int(ids[choice])
