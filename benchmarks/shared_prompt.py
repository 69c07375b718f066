"""n answers to one prompt: read once and copied (the decoder's prompt sharing) against each answer reading it.

    python benchmarks/shared_prompt.py

Gemma-3-270M on the native runtime, prompt lookup at fixed k 4: a 500-token prompt (the README's text), 4 sampled
answers of 16 tokens with their own seeds, decoded as one batch; the two ways take turns in one process (the sharing
switched off by replacing ``Decoder._share_prompts``), 4 rounds; prints the median seconds of each and whether the
answers are identical.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from specdec import GenerationConfig, Generator
from specdec.config import BatchConfig, RuntimeConfig, SamplingConfig
from specdec.engine.decoder import Decoder


def main() -> None:
    fixed = GenerationConfig(max_new_tokens=16, k=4, k_policy="fixed")
    gen = Generator("gemma-3-270m", "prompt-lookup", fixed, RuntimeConfig(backend="native"), BatchConfig(k_cap="fixed"))
    prompt = gen.encode((Path(__file__).parents[1] / "README.md").read_text()[:2400])[:500]
    configs = [
        GenerationConfig(max_new_tokens=16, k=4, k_policy="fixed", sampling=SamplingConfig(temperature=1.0), seed=s)
        for s in range(4)
    ]
    sharing = Decoder._share_prompts
    ways = {"shared": sharing, "each reads it": lambda self, joining, row_ids: None}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    answers = {}
    try:
        for _ in range(4):
            for way, share in ways.items():
                Decoder._share_prompts = share  # type: ignore[method-assign]
                start = time.perf_counter()
                answers[way] = [r.token_ids for r in gen.generate_batch([prompt] * len(configs), configs)]
                seconds[way].append(time.perf_counter() - start)
    finally:
        Decoder._share_prompts = sharing  # type: ignore[method-assign]
    print(
        f"prompt {len(prompt)} tokens, {len(configs)} answers; identical: {len(set(map(str, answers.values()))) == 1}"
    )
    for way, times in seconds.items():
        print(f"{way}: median {statistics.median(times):.3f} s ({', '.join(f'{t:.3f}' for t in times)})")


if __name__ == "__main__":
    main()
