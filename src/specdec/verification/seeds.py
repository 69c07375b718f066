"""One seed, one random generator per device: CUDA refuses to draw with a CPU generator, and the reverse.

A sequence's draws happen where their tensors live: the verifier's on the
target's logits, a model drafter's on its own logits, an n-gram drafter's on
the host. Each device gets a generator seeded from the sequence's seed on
first use, so a seeded run is reproducible on the devices it runs on.
"""

from __future__ import annotations

import torch


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

    def _create(self, device: torch.device) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.seed)
