"""Sampling parameters and next-token selection: torch (numpy for greedy rows on the CPU), no model. The logits
may live on any device; a step's rows are sampled there, and only the picked ids (with each row's finiteness)
come to the host."""

from __future__ import annotations

import math
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
    """A request's optional sampling fields (chatd.service.types.GenerationOptions has this shape); None = default."""

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


# On the CPU, a row with no top-k draws its candidates from this many best tokens when they hold the nucleus
# (top-p mass) whole, which is nearly always; only otherwise is the row sorted whole. On a GPU such a row is
# sorted whole at once: that costs less there than finding out, which would need another wait for the device.
NUCLEUS_CANDIDATES = 1024


# Logits dtypes numpy reads as they are: on the CPU its argmax (one vectorised pass) takes about a seventh of
# torch's time there (16 rows of a 49,152-token vocabulary: 52 against 360 us, a few percent of a decode step).
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def greedy_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax over ``logits`` ``[rows, vocab]``: the lowest id of the row's largest value, a NaN
    counting as the largest (as torch.argmax and numpy's argmax both have it)."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES:
        return [int(token) for token in logits.numpy().argmax(axis=-1).tolist()]
    return [int(token) for token in logits.argmax(dim=-1).tolist()]


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> list[int | SamplingError]:
    """The next token of every row of ``logits`` ``[rows, vocab]`` (any float dtype, any device), row ``r``
    with ``params[r]`` and ``generators[r]``.

    Per row: greedy when temperature is 0 (ties go to the lowest id, as torch.argmax does). Otherwise
    temperature scaling, then top-k, then top-p (nucleus, keeping at least one token), then a draw by the
    inverse of the kept candidates' cumulative distribution at one uniform number from the row's generator.
    Any positive temperature is safe: the scores are shifted so the best one is 0 before dividing, so they
    can only underflow to -inf, never overflow.

    Everything but the uniform numbers runs where the logits are, for all rows at once, and the host waits
    for the device once: for the picked ids with each row's finiteness. The uniforms are drawn on the host
    (one per sampling row, from its own CPU generator, so a seeded row draws the same whatever else is in
    the step) and go to the device with the parameters in one copy that does not wait.

    A sampling row whose logits are not all finite gets a SamplingError in its place; the other rows are
    unaffected.
    """
    num_rows, vocab = logits.shape
    drawing = [not p.greedy for p in params]
    if not any(drawing):
        return [*greedy_rows(logits)]
    device = logits.device
    top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    columns = [[p.temperature if draw else 1.0 for p, draw in zip(params, drawing, strict=True)],
               [float(k) for k in top_ks],
               [p.top_p for p in params],
               [float(torch.rand((), generator=g)) if draw and g is not None else 0.5
                for g, draw in zip(generators, drawing, strict=True)],
               [1.0 if draw else 0.0 for draw in drawing]]
    host = torch.tensor(columns, dtype=torch.float32)  # [5, rows]
    settings = (host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device))
    temperatures, ks, top_ps, uniforms, sampled = settings.unbind(0)
    scores = logits.float()
    wanted = [k for k, draw in zip(top_ks, drawing, strict=True) if draw]
    if all(wanted):
        width = max(wanted)
    else:
        width = vocab if device.type != "cpu" else min(vocab, max(max(wanted), NUCLEUS_CANDIDATES))
    whole = not all(wanted)
    picks, short = draw_rows(scores, temperatures, ks, top_ps, uniforms, width, whole)
    chosen = picks if all(drawing) else torch.where(sampled > 0, picks, scores.argmax(dim=-1))
    # A row's sum is finite when every score is (one fast pass); only the rows it flags are checked whole
    # below, since finite scores of ~1e34 can overflow the sum. One transfer for all three.
    values = torch.stack([chosen.double(), scores.sum(dim=-1).double(), short.double()]).tolist()
    ids = [int(token) for token in values[0]]
    ok = [math.isfinite(total) for total in values[1]]
    narrow = values[2]
    for r in (r for r in range(num_rows) if drawing[r] and not ok[r]):
        ok[r] = bool(torch.isfinite(scores[r]).all())
    redo = [r for r in range(num_rows) if narrow[r] and drawing[r] and ok[r]]
    if redo:
        # The CPU's candidates held less than a row's nucleus: that row again, sorted whole.
        rows = torch.tensor(redo, device=device)
        again, _ = draw_rows(scores[rows], temperatures[rows], ks[rows], top_ps[rows], uniforms[rows], vocab, True)
        for r, token in zip(redo, again.tolist(), strict=True):
            ids[r] = token
    return [SamplingError("the model produced non-finite logits") if draw and not good else int(token)
            for token, good, draw in zip(ids, ok, drawing, strict=True)]


def draw_rows(scores: torch.Tensor, temperatures: torch.Tensor, ks: torch.Tensor, top_ps: torch.Tensor,
              uniforms: torch.Tensor, width: int, whole: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row of ``scores`` ``[n, vocab]`` fp32 from its ``width`` best tokens. ``ks``: top-k per
    row (0: none); the rest per row likewise, ``[n]``. ``whole``: some row has no top-k (its probabilities
    are then relative to the whole row, one more pass over it). Returns the token ids ``[n]`` int64 and, per
    row, whether its nucleus reaches past the candidates (a row without top-k whose ``width`` best tokens hold
    less than ``top_p`` of the mass; never when ``width`` is the vocabulary)."""
    vocab = scores.shape[1]
    values, ids = torch.topk(scores, width, dim=-1)  # [n, width], best first
    best = values[:, :1]
    temperatures = temperatures[:, None]
    scaled = (values - best) / temperatures  # [n, width], the first 0
    has_k = ks > 0
    column = torch.arange(width, device=scores.device)
    scaled = scaled.masked_fill(has_k[:, None] & (column[None, :] >= ks[:, None]), float("-inf"))
    # Probabilities within the top-k for a row with one, else within the whole row.
    norm = torch.logsumexp(scaled, dim=-1)
    if whole:
        norm = torch.where(has_k, norm, torch.logsumexp((scores - best) / temperatures, dim=-1))
    probs = (scaled - norm[:, None]).exp()
    short = ~has_k & (probs.sum(dim=-1) < top_ps) if width < vocab else torch.zeros_like(has_k)
    # Drop a candidate when the mass before it already reaches top_p; the first always stays.
    keep = ((probs.cumsum(dim=-1) - probs) < top_ps[:, None]) | (top_ps[:, None] >= 1.0)
    cdf = (probs * keep).cumsum(dim=-1)
    target = uniforms * cdf[:, -1]
    # The first candidate whose cumulative mass passes the target (a kept one with mass above 0).
    choice = (cdf <= target[:, None]).sum(dim=-1).clamp_(max=width - 1)
    return ids.gather(1, choice[:, None])[:, 0], short


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token of one row of ``logits`` ``[vocab]``, as :func:`sample_rows` picks it. Raises
    SamplingError when a sampling row's logits are not all finite; nothing else is changed then."""
    pick = sample_rows(logits.reshape(1, -1), [params], [generator])[0]
    if isinstance(pick, SamplingError):
        raise pick
    return pick
