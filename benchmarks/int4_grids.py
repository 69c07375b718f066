"""Candidate 4-bit weight grids judged on a real model before any kernel is written for them.

Usage: python benchmarks/int4_grids.py --out FILE [--grids NAME,...] [--tokens 8192]

Gemma-3-270M (transformers, float32) has each decoder linear layer's weights replaced by their int4 reconstruction
under a grid (per 32 inputs of an output, w = d u + m with u in [0, 15]; d and m stored as each grid says), and is
scored on the default prompt set in windows of 512: perplexity, and the mean KL divergence from the float32 model's
next-token distribution. Activations and the output head stay float32, so the figures isolate the grid (the native
runtime adds int8 activations and an int8 head on top). KL is the figure to compare: Gemma's int4 perplexity moves
by several points under changes that leave the weights' error alike.

Bits a weight, over the layers' shapes: 4 for u, plus the grid's bits for d and m per 32 inputs, plus two float16
scales per super-block of groups (a row's last super-block may hold fewer groups).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.bench.perplexity import read_tokens
from specdec.bench.prompts import DEFAULT_PROMPTS, prompt_sets
from specdec.config import RuntimeConfig
from specdec.engine import Generator
from specdec.machine import fingerprint
from specdec.models.native import formats

GROUP = 32
INF = float("inf")


@dataclass(frozen=True)
class Grid:
    """How d and m are stored: float16 values per ``span`` inputs (``covering``: m rounded down and d up where
    rounding to nearest would leave the span's extremes off the grid, as formats.quantize_int4 does), or ``bits``-bit
    codes times a float16 scale per super-block of ``super_groups`` groups (None: per output row)."""

    span: int = GROUP
    covering: bool = True
    bits: int | None = None
    super_groups: int | None = None

    def bits_a_weight(self, width: int) -> float:
        if self.bits is None:
            return 4 + 32 / self.span
        groups = width // GROUP
        supers = 1 if self.super_groups is None else math.ceil(groups / self.super_groups)
        return 4 + 2 * self.bits / GROUP + 32 * supers / width

    def __call__(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The minima and steps [out, in / 32] of the weights [out, in]."""
        if self.bits is None:
            spans = w.reshape(w.shape[0], -1, self.span)
            low, high = spans.amin(2), spans.amax(2)
            least = _float16(low, down=True) if self.covering else low.half().float()
            step = ((high - (least if self.covering else low)) / 15).half().float()
            if self.covering:
                step = torch.where(least + 15 * step < high, _next(step, INF), step)
            repeat = self.span // GROUP
            return least.repeat_interleave(repeat, 1), step.repeat_interleave(repeat, 1)
        groups = w.reshape(w.shape[0], -1, GROUP)
        low, high = groups.amin(2), groups.amax(2)
        count = groups.shape[1] if self.super_groups is None else self.super_groups
        least = _coded(low, count, 2 ** (self.bits - 1) - 1, down=True)
        return least, _coded((high - least) / 15, count, 2**self.bits - 1, down=False)


def _next(x: torch.Tensor, toward: float) -> torch.Tensor:
    """The float16 value next to float16 values ``x`` (as float32) toward ``toward``."""
    half = x.half()
    return torch.nextafter(half, torch.full_like(half, toward)).float()


def _float16(x: torch.Tensor, down: bool) -> torch.Tensor:
    """x rounded to float16, then one float16 step down (or up) where that rounding went the other way."""
    rounded = x.half().float()
    return (
        torch.where(rounded > x, _next(rounded, -INF), rounded)
        if down
        else torch.where(rounded < x, _next(rounded, INF), rounded)
    )


def _coded(values: torch.Tensor, groups: int, top: int, down: bool) -> torch.Tensor:
    """``values`` [out, n] as integer codes in [-top, top] (``down``: rounded down) or [0, top] (rounded up) times a
    float16 scale per ``groups`` consecutive values of a row (the last may hold fewer)."""
    n = values.shape[1]
    padded = torch.nn.functional.pad(values, (0, -n % groups)).reshape(values.shape[0], -1, groups)
    largest = padded.abs().amax(2, keepdim=True)
    scale = _float16(largest / top, down=False)  # the largest value's code within [-top, top]
    ratio = padded / torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.where(ratio == torch.round(ratio), ratio, torch.floor(ratio) if down else torch.ceil(ratio))
    return (scale * codes.clamp(-top if down else 0, top)).reshape(values.shape[0], -1)[:, :n]


GRIDS: dict[str, Grid | None] = {
    "float32": None,
    "float16 per 32, to nearest": Grid(covering=False),
    "float16 per 32, covering (shipped)": Grid(),
    "float16 per 64, covering": Grid(span=64),
    "8-bit codes, a scale per row": Grid(bits=8),
    "8-bit codes, a scale per 8 groups": Grid(bits=8, super_groups=8),
    "6-bit codes, a scale per 8 groups (Q4_K's layout)": Grid(bits=6, super_groups=8),
    "8-bit codes, a scale per 4 groups": Grid(bits=8, super_groups=4),
    "6-bit codes, a scale per 4 groups": Grid(bits=6, super_groups=4),
}


def reconstructed(w: torch.Tensor, grid: Grid) -> torch.Tensor:
    least, step = grid(w)
    groups = w.reshape(w.shape[0], -1, GROUP)
    safe = torch.where(step == 0, torch.ones_like(step), step)
    u = torch.round((groups - least[:, :, None]) / safe[:, :, None]).clamp(0, 15)
    return (u * step[:, :, None] + least[:, :, None]).reshape(w.shape)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--grids", help=f"comma-separated, of: {'; '.join(GRIDS)}")
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    names = args.grids.split(",") if args.grids else list(GRIDS)
    unknown = [n for n in names if n not in GRIDS]
    if unknown:
        parser.error(f"unknown grids {unknown}: use names from {list(GRIDS)}")
    generator = Generator("gemma-3-270m", "none", runtime=RuntimeConfig(backend="transformers"))
    model = generator.target.backend.model
    layers = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    original = {n: m.weight.detach().clone() for n, m in layers.items()}
    tokens = read_tokens(generator.target.tokenizer, str(prompt_sets()[DEFAULT_PROMPTS]), args.tokens)
    windows = [tokens[i : i + 512] for i in range(0, len(tokens) - 1, 512) if len(tokens[i : i + 512]) > 1]

    def log_probs() -> list[torch.Tensor]:
        return [torch.log_softmax(model(input_ids=torch.tensor([w])).logits[0].float(), -1) for w in windows]

    reference = log_probs()
    shipped = next(iter(layers.values())).weight.detach().float()
    _, step, least = formats.quantize_int4(shipped)
    covering = GRIDS["float16 per 32, covering (shipped)"](shipped)
    assert all(torch.equal(a, b) for a, b in zip((least, step), covering, strict=True)), "the script's grid drifted"
    counts = {n: m.weight.numel() for n, m in layers.items()}
    results = {}
    for name in names:
        grid = GRIDS[name]
        for n, layer in layers.items():
            layer.weight.copy_(original[n] if grid is None else reconstructed(original[n].float(), grid))
        got = log_probs()
        pairs = zip(got, windows, strict=True)
        nll = sum(-float(g[:-1].gather(1, torch.tensor(w[1:])[:, None]).sum()) for g, w in pairs)
        kl = sum(float((r.exp() * (r - g)).sum()) for r, g in zip(reference, got, strict=True))
        positions = sum(len(w) for w in windows)
        bits = 32.0 if grid is None else sum(grid.bits_a_weight(layers[n].in_features) * c for n, c in counts.items())
        results[name] = {
            "bits": bits if grid is None else bits / sum(counts.values()),
            "perplexity": math.exp(nll / sum(len(w) - 1 for w in windows)),
            "kl": kl / positions,
        }
        print(
            f"{name}: {results[name]['bits']:.3f} bits, perplexity {results[name]['perplexity']:.3f}, "
            f"KL {results[name]['kl']:.4f}"
        )
    record = {"machine": fingerprint(), "model": "gemma-3-270m", "tokens": len(tokens), "grids": results}
    args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
