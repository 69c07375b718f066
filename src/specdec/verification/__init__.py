"""Verification: pure tensor math that decides which draft tokens the target accepts.

It knows no model: it takes logits or probabilities as tensors and returns a :class:`Verdict` per batch. The words,
defined once:

- **accepted** tokens: the draft's tokens (a chain's first ones, or a tree's nodes along one path from the root) that
  the target keeps. Greedy: each equals the target's argmax after what precedes it. Sampled: each passes rejection
  sampling (accepted with probability min(1, p / q)), so what is kept follows the target's distribution p exactly.
- a **recovered** token: after the first rejected draft token, the target's own token in its place, drawn from the
  residual norm(max(0, p - q)) (greedy: the argmax).
- a **bonus** token: when every draft token of the path is accepted, the target's token after the last one, drawn
  from p at the next position (greedy: the argmax).

A step therefore yields its accepted tokens plus exactly one more, recovered or bonus: ``Verdict.next_token``.

Sampled verdicts are decided by uniforms the caller passes (``Uniforms``; the engine keys them by position, so that
a seed decides each token whatever the step's shape) or draws from a generator.

``judge`` (verifiers.py) dispatches a batch's rows to these verifiers by :class:`Kind`: the row's :class:`Rule` (greedy,
sampled or typical, fixed when it joins) and whether its drafts are a tree.
"""

from specdec.verification.rejection import Uniforms, Verdict, verify
from specdec.verification.shaping import shape_logits, to_probs
from specdec.verification.tree import verify_tree_greedy, verify_tree_sampled
from specdec.verification.typical import typical_verify
from specdec.verification.verifiers import Drafts, Kind, RowDrafts, Rule, judge

__all__ = [
    "Drafts",
    "Kind",
    "RowDrafts",
    "Rule",
    "judge",
    "Uniforms",
    "Verdict",
    "verify",
    "verify_tree_greedy",
    "verify_tree_sampled",
    "typical_verify",
    "shape_logits",
    "to_probs",
]
