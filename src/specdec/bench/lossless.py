"""Statistical checks that sampled output follows the target's law, shared by the test suite and the GPU self-check.

The law of a continuation is the product of the target's conditionals, so
the check compares, position by position, the counts of the next token after
each observed prefix with the exact shaped target distribution there (a
chi-square summed over prefixes). It reads complete outputs only, so any
driver (single sequence, batched rows, a server) can be checked the same way.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specdec.config import SamplingConfig
from specdec.engine import DecodeStats
from specdec.verification import to_probs

#: how a drafting step ended: rejection at the 1st, 2nd or a later draft; all of 2+ drafts accepted (then a bonus token)
STEP_CASES = ("rejected at 1st", "rejected at 2nd", "rejected at 3rd+", "bonus after 2+ drafts")


class TargetLaw:
    """The shaped target distribution of the next token after ``prompt`` + prefix, by full forwards without a cache."""

    def __init__(self, model: PreTrainedModel, prompt: list[int], sampling: SamplingConfig) -> None:
        self.model, self.prompt, self.sampling = model, prompt, sampling
        self.device = next(model.parameters()).device
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self._cache:
            with torch.no_grad():
                logits = self.model(torch.tensor([self.prompt + list(prefix)], device=self.device)).logits[0, -1]
            self._cache[prefix] = to_probs(logits, self.sampling).double().cpu()
        return self._cache[prefix]


def sequential_pvalue(samples: Sequence[tuple[int, ...]], law: TargetLaw, min_group: int = 25) -> tuple[float, int]:
    """(p-value, degrees of freedom) of equal-length samples under the target's law.

    Prefixes seen fewer than ``min_group`` times are skipped; cells expected
    fewer than 5 times are merged. Raises AssertionError if a token outside the
    shaped support was produced (that alone proves the output wrong).
    """
    stat, dof = 0.0, 0
    for j in range(len(samples[0])):
        groups: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        for sample in samples:
            groups[sample[:j]][sample[j]] += 1
        for prefix, counter in groups.items():
            p = law(prefix)
            observed = torch.zeros_like(p)
            for token, count in counter.items():
                observed[token] = count
            if observed[p == 0].sum() > 0:
                raise AssertionError(f"a token outside the shaped target's support was produced after prefix {prefix}")
            n = observed.sum()
            if n < min_group:
                continue
            expected = p * n
            big = expected >= 5
            obs = torch.cat([observed[big], observed[~big].sum()[None]])
            exp = torch.cat([expected[big], expected[~big].sum()[None]])
            keep = exp > 0
            if keep.sum() < 2:
                continue
            stat += float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
            dof += int(keep.sum()) - 1
    return chi_square_survival(stat, dof), dof


def step_cases(stats: Sequence[DecodeStats]) -> Counter:
    """How many drafting steps ended each way (STEP_CASES, plus "bonus after 1 draft")."""
    cases: Counter = Counter()
    for s in stats:
        for proposed, accepted in zip(s.proposed_per_step, s.accepted_per_step, strict=True):
            if not proposed:
                continue
            if accepted == proposed:
                cases["bonus after 2+ drafts" if proposed >= 2 else "bonus after 1 draft"] += 1
            else:
                cases[STEP_CASES[min(accepted, 2)]] += 1
    return cases


def chi_square_survival(stat: float, dof: int) -> float:
    """P(X >= stat) for X chi-square with ``dof`` degrees of freedom: the regularized upper incomplete gamma
    Q(dof/2, stat/2)."""
    if dof == 0:
        return 1.0
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )
