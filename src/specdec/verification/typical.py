"""LOSSY typical acceptance (Cai et al. 2024, Medusa; vLLM's TypicalAcceptanceSampler), vectorised over the batch.

A draft token is accepted while the target gives it probability above
min(epsilon, alpha * exp(-H)), H being the entropy of the target's distribution
at that position: confident positions demand the likely token, uncertain ones
accept any plausible one. The token after the accepted prefix is the target's
argmax (greedy) or a draw from the target (sampling). Output no longer follows
the target exactly; the engine uses this only when a config asks for it.
"""

from __future__ import annotations

import torch

from specdec.config import SamplingConfig, TypicalAcceptance
from specdec.verification.rejection import Uniforms, Verdict, leading_true
from specdec.verification.sampling import draw, greedy
from specdec.verification.shaping import to_probs


def typical_verify(
    draft_tokens: torch.Tensor,
    draft_lengths: torch.Tensor,
    target_logits: torch.Tensor,
    sampling: SamplingConfig,
    rule: TypicalAcceptance,
    rng: torch.Generator | None = None,
    temperature: torch.Tensor | None = None,
    uniforms: Uniforms | None = None,
) -> Verdict:
    """Accept drafts [B, k] against target logits [B, k + 1, V] by the typical rule; see :func:`verify` for the
    shapes (only ``uniforms.sample`` is read: acceptance draws nothing)."""
    k = draft_tokens.shape[1]
    p = target_logits.float().softmax(dim=-1) if sampling.greedy else to_probs(target_logits, sampling, temperature)
    entropy = -(p * p.clamp(min=1e-30).log()).sum(dim=-1)
    threshold = torch.minimum(torch.full_like(entropy, rule.epsilon), rule.alpha * torch.exp(-entropy))
    p_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    in_range = torch.arange(k, device=target_logits.device)[None, :] < draft_lengths[:, None]
    accepted = leading_true((p_draft > threshold[:, :k]) & in_range)
    rows = torch.arange(p.shape[0], device=p.device)
    p_next = p[rows, accepted]
    if sampling.greedy:
        next_token = greedy(p_next)
    else:
        next_token = draw(p_next, rng, None if uniforms is None else uniforms.sample[rows, accepted])
    return Verdict(accepted, next_token)
