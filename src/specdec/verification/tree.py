"""Exact verification of a tree of drafts (SpecInfer, Miao et al. 2024; Sequoia, Chen et al. 2024).

The target scored every node in one forward: column 0 of a row's logits judges
the children of the root (the context's last token), column j + 1 the children
of node j. Verification walks down from the root and keeps one path:

- greedy: the child whose token is the target's argmax, while there is one;
- sampling, drawn siblings: recursive rejection over the siblings. The first
  child x, drawn from q, is accepted with probability min(1, p(x) / q(x)); if
  rejected, p becomes norm(max(0, p - q)) and the next sibling is tried against
  it; when every sibling is rejected the next token is drawn from what is left of p;
- sampling, deterministic siblings (recursive rejection with one-hot q's amounts
  to this): the target draws from p with the level's uniform and descends while
  its draw is a child, so the tokens are the target's own draws, whatever was drafted.

Either way the produced tokens follow p exactly, whatever the tree's shape.
"""

from __future__ import annotations

import torch

from specdec.config import SamplingConfig
from specdec.verification.rejection import Uniforms, Verdict, residual_distribution
from specdec.verification.sampling import draw
from specdec.verification.shaping import to_probs


def verify_tree_greedy(
    tokens: torch.Tensor, parents: torch.Tensor, counts: torch.Tensor, argmax: torch.Tensor
) -> Verdict:
    """Greedy verdicts for a batch of trees, vectorised over rows and nodes.

    Args:
        tokens: [B, n] node tokens (entries past a row's count are ignored); parents: [B, n] as in ``Proposal``.
        counts: [B] nodes per row. argmax: [B, n + 1] the target's argmax at each column (``sampling.greedy`` of its
        logits), column j + 1 choosing among node j's children.
    """
    n = tokens.shape[1]
    real = torch.arange(n, device=tokens.device)[None, :] < counts[:, None]
    parents = torch.where(real, parents, -1)
    if n > 1:  # distinct siblings, or two matching nodes could make two paths
        keys = (parents + 1) * (int(tokens.max()) + 1) + tokens
        keys = torch.where(real, keys, -1 - torch.arange(n, device=tokens.device)[None, :]).sort(dim=1).values
        if bool((keys[:, 1:] == keys[:, :-1]).any()):
            raise ValueError(
                "a greedy tree has two siblings with the same token: a drafter must propose distinct siblings"
            )
    match = (tokens == argmax.gather(1, parents + 1)) & real  # the target would have chosen this node after its parent
    on_path = match
    for _ in range(n):  # a node is on the path when it and every ancestor match: one more level per pass
        deeper = match & ((parents < 0) | on_path.gather(1, parents.clamp(min=0)))
        if torch.equal(deeper, on_path):
            break
        on_path = deeper
    # Siblings are distinct, so the matching nodes form one path; parents come first, so its last node is the deepest.
    index = torch.arange(n, device=tokens.device).expand_as(on_path)
    last = torch.where(on_path, index, -1).max(dim=1).values if n else torch.full_like(counts, -1)
    next_tokens = argmax.gather(1, (last + 1)[:, None]).squeeze(1)
    paths = [row.nonzero().squeeze(1).tolist() for row in on_path.cpu()]
    return Verdict(on_path.sum(dim=1), next_tokens, paths)


def verify_tree_sampled(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingConfig,
    rng: torch.Generator | None = None,
    temperature: torch.Tensor | None = None,
    uniforms: Uniforms | None = None,
) -> Verdict:
    """The sampled verdict for one tree: tokens, parents [n], logits [n + 1, V], draft_probs [n, V] or None
    (deterministic nodes); ``uniforms`` as :class:`Uniforms` for a tree (None: drawn with ``rng``)."""
    p = to_probs(logits[None], sampling, None if temperature is None else temperature[None])[0]
    n = len(tokens)
    if uniforms is None:
        uniforms = Uniforms.drawn((n + 1,), (n,), p.device, rng)
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents.tolist()):
        children.setdefault(parent, []).append(node)
    listed = tokens.tolist()
    path: list[int] = []
    node = -1
    while True:
        remaining = p[node + 1]
        level = uniforms.sample[len(path) : len(path) + 1]
        if draft_probs is None:  # the target's draw, and the child that drafted it if one did
            choice = draw(remaining[None], uniform=level)
            drawn = int(choice)
            drafted = [child for child in children.get(node, []) if listed[child] == drawn]
            if not drafted:
                return Verdict(torch.tensor([len(path)], device=p.device), choice, [path])
            path.append(drafted[0])
            node = drafted[0]
            continue
        for child in children.get(node, []):
            x = listed[child]
            q = draft_probs[child]
            if bool(uniforms.accept[child] * q[x] < remaining[x]):  # u < p / q without dividing by zero
                path.append(child)
                node = child
                break
            remaining = residual_distribution(remaining[None], q[None])[0]
        else:  # every child rejected (or none): the next token comes from what is left of p
            return Verdict(torch.tensor([len(path)], device=p.device), draw(remaining[None], uniform=level), [path])
