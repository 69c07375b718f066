"""One seed per sequence: every random number of a sequence is a function of its seed, the device it is drawn on, and
what it decides.

A draw is keyed, not taken from a stream: the uniform that decides something about the token at position t of the
sequence (its index among the prompt and output tokens) is a hash of (seed, what it decides, t, which candidate),
the same whichever step reaches t, however many numbers earlier steps drew, whatever drafted before it. So a seeded
sequence's draws do not depend on its k policy, the batch's window, or what a learning drafter kept from earlier
sequences. What they decide (:data:`SAMPLE`, :data:`ACCEPT`, :data:`DRAFT`) are independent keys, so the verifier's
uniforms are independent of the draft's own.

Draws on different devices use different keys: the host's is the sequence's seed, any other device's a value mixed
from it and the device's name, which also seeds the device's stream (:meth:`Seeds.on`, for drafters that draw from a
stream of their own).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

MASK = (1 << 64) - 1

#: the target's own token at a position: drawn from its distribution, or from the residual after a rejected draft
SAMPLE = 0
#: the acceptance test of a drawn draft token (candidate i: the i-th sibling of a tree level)
ACCEPT = 1
#: a drafter's draw of its draft token (candidate i: the i-th sibling)
DRAFT = 2


class Seeds:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def on(self, device: torch.device | str) -> torch.Generator:
        """The generator that draws on ``device``; its seed keys the device's keyed draws too."""
        device = _concrete(device)
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = self._create(device)
        return generator

    def seed_for(self, device: torch.device) -> int:
        """The host draws with the sequence's own seed; any other device with a seed mixed from it and the device's
        name."""
        if device.type == "cpu":
            return self.seed
        # manual_seed takes 63 bits here
        return _mix(self.seed ^ zlib.crc32(f"{device.type}:{device.index}".encode())) >> 1

    def uniforms(self, device: torch.device | str, draws: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """One uniform in [0, 1) per (what, position, candidate) of ``draws`` (what: SAMPLE, ACCEPT or DRAFT), each a
        function of those three and the device's seed alone: [len(draws)] on ``device``, float64 (float32 on MPS,
        which has none)."""
        device = _concrete(device)
        key = self.on(device).initial_seed()
        values = torch.tensor([keyed_uniform(key, *draw) for draw in draws], dtype=torch.float64)
        return values.to(torch.float32 if device.type == "mps" else torch.float64).to(device)

    def _create(self, device: torch.device) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.seed_for(device))


def rng_on(seeds: Seeds | None, device: torch.device) -> torch.Generator | None:
    """The random generator of ``seeds`` for ``device``, or None (torch's global one) for an unseeded draw."""
    return seeds.on(device) if seeds is not None else None


def draft_uniform(seeds: Seeds | None, device: torch.device, position: int, candidate: int = 0) -> torch.Tensor | None:
    """The uniform [1] on ``device`` with which a drafter draws its ``candidate``-th token for ``position`` (see
    :func:`specdec.verification.sampling.draw`), or None for an unseeded draw (torch's global generator)."""
    return None if seeds is None else seeds.uniforms(device, [(DRAFT, position, candidate)])


def keyed_uniform(key: int, what: int, position: int, candidate: int = 0) -> float:
    """A uniform in [0, 1) with 53 random bits, a function of its four arguments alone (SplitMix64's finaliser
    chained over them: a counter-based generator, as Philox is)."""
    x = _mix(key & MASK)
    x = _mix(x ^ ((position * 0x9E3779B97F4A7C15) & MASK))
    x = _mix(x ^ ((((what << 32) | candidate) * 0xC2B2AE3D27D4EB4F) & MASK))
    return (x >> 11) * 2.0**-53


def _concrete(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` among several answers to one seeded request: the request's own for the first,
    unrelated ones for the rest (so n answers are n independent draws, each reproducible)."""
    return seed if choice == 0 else _mix(seed ^ _mix(choice))


def _mix(x: int) -> int:
    """SplitMix64's finaliser: nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)
