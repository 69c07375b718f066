"""Verification: pure tensor math that decides which draft tokens the target accepts.

It knows no model: it takes logits or probabilities as tensors and returns, per
batch row, how many draft tokens were accepted and the target's next token.
"""

from specdec.verification.rejection import Verdict, verify
from specdec.verification.shaping import shape_logits, to_probs
from specdec.verification.typical import typical_verify

__all__ = ["Verdict", "verify", "typical_verify", "shape_logits", "to_probs"]
