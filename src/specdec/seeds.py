"""One seed, one random generator per device: CUDA refuses to draw with a CPU generator, and the reverse.

A sequence's draws happen where their tensors live: the verifier's on the
target's logits, a model drafter's on its own logits, an n-gram drafter's on
the host. Each device gets a generator on first use, seeded from the
sequence's seed and the device (two GPUs of one kind would otherwise draw the
same numbers, and a draft's draws on one would decide the verifier's
acceptance on the other), so a seeded run is reproducible on the devices it runs on.
"""

from __future__ import annotations

import zlib

import torch

MASK = (1 << 64) - 1


class Seeds:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def on(self, device: torch.device | str) -> torch.Generator:
        """The generator that draws on ``device``."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
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

    def _create(self, device: torch.device) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.seed_for(device))


def rng_on(seeds: Seeds | None, device: torch.device) -> torch.Generator | None:
    """The random generator of ``seeds`` for ``device``, or None (torch's global one) for an unseeded draw."""
    return seeds.on(device) if seeds is not None else None


def _mix(x: int) -> int:
    """SplitMix64's finaliser: nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)
