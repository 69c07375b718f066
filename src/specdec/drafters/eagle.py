"""A feature-conditioned draft head (EAGLE, Li et al. 2024): drafts from the target's own hidden states.

A small draft that sees only tokens has to rediscover what the target already
computed; this head reads it. At context position t it takes the target's final
hidden state f_t (what the target's output head reads, returned by the same
forward that verifies: ``Backend.forward(features=True)``) and the embedding of
token t + 1, maps both to the hidden width (``fc``), runs one decoder layer of
the target's family and predicts token t + 2 over the N most frequent tokens
(the target's own output rows, as the distilled drafts do). Its output hidden
state stands in for the target's next feature, so it drafts further positions
autoregressively over its own features.

Drafts grow as a tree (EAGLE-2): each level expands the ``branches`` most likely
nodes (by the product of the head's probabilities along their path) with their
``branches`` most likely tokens in one forward of the head; the k most likely
nodes of all levels form the proposal. With one branch it is a chain. The
proposal is deterministic (the head's top tokens), so verification draws from
the target and descends while the draw is a child: exact at any temperature.

A draft folder holds ``config.json`` (the head's transformers config),
``model.safetensors`` (fc, layer, norm, its output rows and kept token ids: it
needs only the target's input embedding, so it runs on every backend) and ``specdec_draft.json``
with ``arch.eagle`` set.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel

from specdec.drafters.base import DraftSettings, Proposal
from specdec.errors import ConfigError
from specdec.verification.shaping import to_probs

MAX_DEPTH = 6  # levels of a tree: deeper nodes are rarely reached and each level costs a forward of the head
MIN_SCORE = 0.02  # a node the head gives less than this chance of being reached is not worth verifying


Embed = Callable[[torch.Tensor], torch.Tensor]  # the target's input embedding, scale included (Backend.token_embeddings)


def build_eagle(target: PreTrainedModel, keep_ids: torch.Tensor, layers: int) -> PreTrainedModel:
    """A new head for ``target``: ``fc`` (2H -> H), ``layers`` decoder layers (full attention) started as copies of the target's
    last ones, a norm, and the target's output rows for ``keep_ids`` as its (frozen) output head."""
    rows = target.get_output_embeddings().weight.detach()[keep_ids].clone()
    head = eagle_skeleton(target.config.get_text_config(), rows, keep_ids, layers)
    for mine, theirs in zip(head.model.layers, target.model.layers[-layers:], strict=True):
        mine.load_state_dict({k: v for k, v in theirs.state_dict().items() if k in mine.state_dict()}, strict=False)
    head.model.norm.load_state_dict(target.model.norm.state_dict())
    hidden = rows.shape[1]
    with torch.no_grad():  # start as "the embedding plus a little of the feature"
        head.eagle_fc.weight.zero_()
        head.eagle_fc.weight[:, :hidden].copy_(torch.eye(hidden))
        head.eagle_fc.weight[:, hidden:].copy_(0.1 * torch.eye(hidden))
    return head.to(device=target.device, dtype=target.dtype)


def eagle_skeleton(config: PretrainedConfig, rows: torch.Tensor, keep_ids: torch.Tensor, layers: int) -> PreTrainedModel:
    """The head's modules in ``config``'s family (weights to be loaded), with ``rows`` [N, H] as its frozen output head."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * layers  # the head's context is short: no sliding window
    config.vocab_size = len(keep_ids)
    config.tie_word_embeddings = False
    head = AutoModelForCausalLM.from_config(config).to(dtype=rows.dtype)
    head.model.embed_tokens = nn.Identity()  # tokens are embedded by the target's own embedding (head_forward's ``embed``)
    head.lm_head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, dtype=rows.dtype)
    head.lm_head.weight = nn.Parameter(rows, requires_grad=False)
    head.eagle_fc = nn.Linear(2 * rows.shape[1], rows.shape[1], bias=False, dtype=rows.dtype)
    head.register_buffer("keep_ids", keep_ids.clone(), persistent=False)
    return head


def head_forward(
    head: PreTrainedModel,
    embed: Embed,
    tokens: torch.Tensor,
    features: torch.Tensor,
    positions: torch.Tensor,
    cache: DynamicCache | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits over the kept tokens and the head's output features for pairs (features[b, i], tokens[b, i]) at ``positions``.

    ``mask``: additive [B, 1, n, cached + n], or None for causal attention.
    """
    dtype = head.eagle_fc.weight.dtype
    x = head.eagle_fc(torch.cat([embed(tokens).to(dtype), features.to(dtype)], dim=-1))
    if mask is not None and getattr(head.config, "layer_types", None):
        mask = {"full_attention": mask, "sliding_attention": mask}  # type: ignore[assignment]
    out = head(
        inputs_embeds=x, position_ids=positions, cache=cache, use_cache=cache is not None, attention_mask=mask, output_hidden_states=True
    )
    return out.logits, out.hidden_states[-1]


class EagleDrafter:
    """Drafts trees (or chains) with a feature-conditioned head; the engine hands it the target's hidden states every step."""

    backend = None  # the head is not a Backend: its cost is learned from measured drafting time
    wants_features = True
    scored = True  # its proposals carry scores: the engine asks for the most nodes and keeps the ones worth verifying

    def __init__(
        self, head: PreTrainedModel, embed: Embed, full_vocab: int, max_depth: int = MAX_DEPTH, min_score: float = MIN_SCORE
    ) -> None:
        self.head, self.embed = head, embed
        self.vocab_size: int | None = full_vocab
        self.max_depth, self.min_score = max_depth, min_score
        self.device = head.eagle_fc.weight.device
        self.keep_ids = head.keep_ids
        self.settings = DraftSettings()
        self.begin(self.settings)

    def begin(self, settings: DraftSettings) -> None:
        self.settings = settings
        self.cache = DynamicCache(config=self.head.config)
        self.read = 0  # context pairs in the head's cache
        self.features: list[torch.Tensor] = []  # the target's, one [n, H] piece per step, for the positions after ``read``
        self.known = 0  # context positions whose target features arrived

    def observe_features(self, features: torch.Tensor) -> None:
        """The target's final hidden states of the next context positions (those it cached this step)."""
        self.features.append(features.to(self.device))
        self.known += len(features)

    def accept(self, n: int) -> None:
        pass  # the head re-reads the accepted tokens with the target's features at the next step

    def fork(self) -> EagleDrafter:
        return EagleDrafter(self.head, self.embed, self.vocab_size, self.max_depth, self.min_score)  # type: ignore[arg-type]

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, k: int) -> Proposal:
        length = context.shape[0]
        if self.read == 0 and 0 < self.known < length - 1:  # begun mid-sequence (a guard's anchor): read from the first position it has
            self.read = length - 1 - self.known
        if self.known == 0 or k < 1:  # the first step: the target has not read the prompt yet
            return Proposal.empty()
        # Read the new context pairs (f_t, x_{t+1}) with the target's features: their last output drafts x_length.
        features = torch.cat(self.features)[: length - 1 - self.read]
        self.features = []
        tokens = context[self.read + 1 : length].to(self.device)
        positions = torch.arange(self.read, length - 1, device=self.device)
        logits, out = head_forward(self.head, self.embed, tokens[None], features[None], positions[None], self.cache)
        self.read = length - 1
        tree = self._grow(logits[0, -1], out[0, -1], k, length)
        # Forget the drafts' own states (crop takes the count to remove): the next step reads the accepted ones with the target's features.
        if self.cache.get_seq_length() > self.read:
            self.cache.crop(self.read - self.cache.get_seq_length())
        return tree

    def _grow(self, logits: torch.Tensor, feature: torch.Tensor, k: int, length: int) -> Proposal:
        """The k most likely nodes of a tree grown level by level, expanding the ``branches`` most likely nodes of each level."""
        width = self.settings.branches
        sampling = self.settings.sampling
        shape = (lambda z: torch.softmax(z.float(), dim=-1)) if sampling.greedy else (lambda z: to_probs(z, sampling))
        nodes: list[tuple[float, int, int]] = []  # (score, kept-vocabulary token, parent node), level by level
        frontier = [(-1, 1.0, shape(logits), feature)]  # (node, score, the head's distribution after it, its output feature)
        slots: dict[int, int] = {}  # node -> its slot in the head's cache
        for depth in range(min(self.max_depth, k)):
            children = []
            for node, score, probs, _ in frontier:
                top = probs.topk(width)
                children += [(score * p, t, node) for p, t in zip(top.values.tolist(), top.indices.tolist(), strict=True)]
            children = [c for c in children if c[0] >= self.min_score]
            if not children:
                break
            start = len(nodes)
            nodes += children
            expand = sorted(range(start, len(nodes)), key=lambda i: -nodes[i][0])[:width]
            if depth + 1 == min(self.max_depth, k) or length + depth + 1 >= self.head.config.max_position_embeddings:
                break
            frontier = self._expand(expand, nodes, frontier, slots, shape, depth)
        # The k best nodes, best first (ties: shallower first): a node's score is its parent's times a probability, so a
        # parent always precedes its children and the engine may keep any prefix of them (CostModelK.tree_size).
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], i))[:k]
        index = {node: i for i, node in enumerate(order)}
        tokens = self.keep_ids[torch.tensor([nodes[i][1] for i in order], dtype=torch.long, device=self.keep_ids.device)].cpu()
        parents = torch.tensor([index[nodes[i][2]] if nodes[i][2] >= 0 else -1 for i in order], dtype=torch.long)
        scores = torch.tensor([nodes[i][0] for i in order])
        return Proposal(tokens, None, parents if width > 1 else None, scores)

    def _expand(self, expand: list[int], nodes: list, frontier: list, slots: dict[int, int], shape, depth: int) -> list:
        """Run the head once over the nodes ``expand`` (each seeing the context and its ancestors); their distributions and features."""
        outputs = {node: out for node, _, _, out in frontier}
        cached = self.cache.get_seq_length()
        n = len(expand)
        visible = torch.zeros(n, cached + n, dtype=torch.bool, device=self.device)
        visible[:, : self.read] = True
        for row, node in enumerate(expand):
            visible[row, cached + row] = True
            parent = nodes[node][2]
            while parent >= 0:
                visible[row, slots[parent]] = True
                parent = nodes[parent][2]
            slots[node] = cached + row
        mask = torch.zeros(visible.shape, device=self.device).masked_fill_(~visible, torch.finfo(torch.float32).min)
        tokens = torch.tensor([nodes[i][1] for i in expand], device=self.device)
        tokens = self.keep_ids[tokens]
        features = torch.stack([outputs[nodes[i][2]] for i in expand])
        positions = torch.full((n,), self.read + depth, device=self.device)  # a depth-0 node follows the last context pair
        mask = mask[None, None].to(self.head.dtype)
        logits, out = head_forward(self.head, self.embed, tokens[None], features[None], positions[None], self.cache, mask)
        return [(node, nodes[node][0], shape(logits[0, row]), out[0, row]) for row, node in enumerate(expand)]


def load_eagle(
    folder: str | Path, embed: Embed, full_vocab: int, device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float32
) -> EagleDrafter:
    """The head saved in ``folder`` by ``specdec distill --arch eagle``, on ``device``, drafting for a target with input embedding ``embed``."""
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    keep_ids, rows = tensors.pop("keep_ids"), tensors.pop("lm_head.weight").to(dtype)
    if int(keep_ids.max()) >= full_vocab:
        raise ConfigError(f"eagle head '{folder}' was distilled for a target with another vocabulary: use it with its own target")
    config = AutoConfig.from_pretrained(folder)
    head = eagle_skeleton(config, rows, keep_ids, config.num_hidden_layers)
    expected = {name for name, p in head.named_parameters() if p.requires_grad}
    missing = expected - set(tensors)
    unexpected = set(tensors) - expected
    if missing or unexpected:
        raise ConfigError(
            f"'{folder}' is not an eagle head of this version (missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    head.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
    head.to(device)
    if embed(torch.zeros(1, dtype=torch.long, device=device)).shape[-1] != rows.shape[1]:
        raise ConfigError(f"eagle head '{folder}' has hidden size {rows.shape[1]}, unlike this target: use it with its own target")
    return EagleDrafter(head.eval(), embed, full_vocab)
