"""Sampling parameters and next-token selection. Pure torch, no model. The logits may live on any device;
only each row's top candidates (and a whole row for a draw over every token) come to the host."""

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


# A row with no top-k draws its candidates from this many best tokens when they hold the nucleus (top-p
# mass) whole, which is nearly always; only otherwise is the row sorted whole.
NUCLEUS_CANDIDATES = 1024


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> list[int | SamplingError]:
    """The next token of every row of ``logits`` ``[rows, vocab]`` (any float dtype, any device), row ``r``
    with ``params[r]`` and ``generators[r]``, in one pass: one argmax for the greedy rows, one finiteness
    check and one top-k for the others; then each sampling row draws from its own generator.

    Per row: greedy when temperature is 0 (ties go to the lowest id, as torch.argmax does). Otherwise
    temperature scaling, then top-k, then top-p (nucleus, keeping at least one token), then a draw from
    the row's generator. Any positive temperature is safe: the scores are shifted so the best one is 0
    before dividing, so they can only underflow to -inf, never overflow.

    A sampling row whose logits are not all finite gets a SamplingError in its place; the other rows are
    unaffected.
    """
    num_rows, vocab = logits.shape
    picks: list[int | SamplingError] = [SamplingError("not sampled")] * num_rows
    greedy = [r for r in range(num_rows) if params[r].greedy]
    if greedy:
        chosen = logits[greedy].argmax(dim=-1).tolist() if len(greedy) < num_rows else logits.argmax(dim=-1).tolist()
        for r, token in zip(greedy, chosen, strict=True):
            picks[r] = int(token)
    drawing = [r for r in range(num_rows) if not params[r].greedy]
    if not drawing:
        return picks
    # The whole rows stay where the logits are (a GPU's memory); the host gets each row's finiteness and
    # its top candidates, and a whole row only for a draw over every token or a very wide nucleus.
    scores = (logits if len(drawing) == num_rows else logits[drawing]).float()  # [n, vocab] fp32
    # A row sum is finite when every score is (one fast pass); only the rows it flags are checked whole,
    # since finite scores of ~1e34 could overflow the sum.
    finite = torch.isfinite(scores.sum(dim=-1)).tolist()
    for i in (i for i, ok in enumerate(finite) if not ok):
        finite[i] = bool(torch.isfinite(scores[i]).all())
    top_ks = [params[r].top_k if 0 < params[r].top_k < vocab else 0 for r in drawing]
    width = max(k if k else min(vocab, NUCLEUS_CANDIDATES) for k in top_ks)
    best_values, best_ids = (t.cpu() for t in torch.topk(scores, width, dim=-1))  # [n, width], best first
    for i, r in enumerate(drawing):
        if not finite[i]:
            picks[r] = SamplingError("the model produced non-finite logits")
            continue
        p = params[r]
        values, ids = best_values[i], best_ids[i]
        if top_ks[i]:
            values, ids = values[:top_ks[i]], ids[:top_ks[i]]
            probs = torch.softmax((values - values[0]) / p.temperature, dim=-1)
        else:
            # Every token is a candidate: probabilities over the whole row.
            shifted = (scores[i] - float(values[0])) / p.temperature  # [vocab], best 0
            if p.top_p >= 1.0:  # no nucleus either: a draw from the whole row, in token order
                whole = torch.softmax(shifted, dim=-1).cpu()
                picks[r] = int(torch.multinomial(whole, 1, generator=generators[r]).item())
                continue
            probs = ((values - values[0]) / p.temperature - float(torch.logsumexp(shifted, dim=0))).exp()
            if float(probs.sum()) < p.top_p:
                # The nucleus is wider than the candidates: the row whole, best first.
                values, ids = torch.sort(scores[i].cpu(), descending=True)
                probs = torch.softmax((values - values[0]) / p.temperature, dim=-1)
        if p.top_p < 1.0:
            # Drop a candidate when the mass before it already reaches top_p; the first always stays.
            kept = int(((probs.cumsum(dim=-1) - probs) < p.top_p).sum())
            probs = probs[:kept]
        choice = int(torch.multinomial(probs, 1, generator=generators[r]).item())
        picks[r] = int(ids[choice])
    return picks


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token of one row of ``logits`` ``[vocab]``, as :func:`sample_rows` picks it. Raises
    SamplingError when a sampling row's logits are not all finite; nothing else is changed then."""
    pick = sample_rows(logits.reshape(1, -1), [params], [generator])[0]
    if isinstance(pick, SamplingError):
        raise pick
    return pick
