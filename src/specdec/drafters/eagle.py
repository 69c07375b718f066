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
``branches`` most likely tokens in one forward of the head (the nodes re-run with their ancestors after the
context, then dropped from its cache); the k most likely
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
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel

from specdec.drafters.base import Drafter, DrafterCapabilities, DraftSettings, Proposal
from specdec.errors import ConfigError
from specdec.models import native
from specdec.models.backend import tree_mask, tree_positions
from specdec.models.loading import model_identity
from specdec.models.native import NativeModel, formats, kernel_build
from specdec.models.native.formats import PackedInt8
from specdec.models.native.paged_cache import PagedCache
from specdec.verification.shaping import to_probs

MAX_DEPTH = 6  # levels of a tree: deeper nodes are rarely reached and each level costs a forward of the head
MIN_SCORE = 0.02  # a node the head gives less than this chance of being reached is not worth verifying
MEASURE_CONTEXT, MEASURE_LEVELS = 64, 4  # a step's cost is measured after a context this long, on chains this long


# the target's input embedding, scale included (Backend.token_embeddings)
Embed = Callable[[torch.Tensor], torch.Tensor]


def build_eagle(target: PreTrainedModel, keep_ids: torch.Tensor, layers: int) -> PreTrainedModel:
    """A new head for ``target``: ``fc`` (2H -> H), ``layers`` decoder layers (full attention) started as copies of the
    target's last ones, a norm, and the target's output rows for ``keep_ids`` as its (frozen) output head."""
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


def eagle_skeleton(
    config: PretrainedConfig, rows: torch.Tensor, keep_ids: torch.Tensor, layers: int
) -> PreTrainedModel:
    """The head's modules in ``config``'s family (weights to be loaded), with ``rows`` [N, H] as its frozen output
    head."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * layers  # the head's context is short: no sliding window
    config.vocab_size = len(keep_ids)
    config.tie_word_embeddings = False
    head = AutoModelForCausalLM.from_config(config).to(dtype=rows.dtype)
    # tokens are embedded by the target's own embedding (head_forward's ``embed``)
    head.model.embed_tokens = nn.Identity()
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
    """Logits over the kept tokens and the head's output features for pairs (features[b, i], tokens[b, i]) at
    ``positions``.

    ``mask``: additive [B, 1, n, cached + n], or None for causal attention.
    """
    dtype = head.eagle_fc.weight.dtype
    x = head.eagle_fc(torch.cat([embed(tokens).to(dtype), features.to(dtype)], dim=-1))
    if mask is not None and getattr(head.config, "layer_types", None):
        mask = {"full_attention": mask, "sliding_attention": mask}  # type: ignore[assignment]
    out = head(
        inputs_embeds=x,
        position_ids=positions,
        cache=cache,
        use_cache=cache is not None,
        attention_mask=mask,
        output_hidden_states=True,
    )
    return out.logits, out.hidden_states[-1]


Cache = TypeVar("Cache")


class HeadRunner(ABC, Generic[Cache]):
    """What runs the head for EagleDrafter: its transformers module (ModuleHead) or the native kernels (NativeHead)."""

    embed: Embed  # the target's input embedding
    keep_ids: torch.Tensor  # the target token of each of the head's outputs
    device: torch.device  # where its inputs go
    max_position: int  # the most positions its cache holds
    identity: str  # the head and what runs it: its measured step cost is cached under this

    @abstractmethod
    def new_cache(self) -> Cache:
        """An empty cache of the head's own."""

    @abstractmethod
    def length(self, cache: Cache) -> int:
        """Entries ``cache`` holds."""

    @abstractmethod
    def truncate(self, cache: Cache, length: int) -> None:
        """Keep the first ``length`` entries of ``cache`` (all of them where it holds fewer)."""

    @abstractmethod
    def run(
        self, cache: Cache, tokens: torch.Tensor, features: torch.Tensor, parents: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, N] and output features [n, H] of pairs (features[i], tokens[i]) appended to ``cache``: a chain, or
        with ``parents`` a tree (each node seeing the cache and its ancestors, at the position of its depth)."""


class ModuleHead(HeadRunner[DynamicCache]):
    """The head run as its transformers module (any device): a DynamicCache, trees by an additive attention mask."""

    def __init__(self, module: PreTrainedModel, embed: Embed) -> None:
        self.module, self.embed = module, embed
        self.keep_ids = module.keep_ids
        self.device = module.eagle_fc.weight.device
        self.max_position = module.config.max_position_embeddings
        self.identity = f"eagle head|{model_identity(module)}"

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.module.config)

    def length(self, cache: DynamicCache) -> int:
        return cache.get_seq_length()

    def truncate(self, cache: DynamicCache, length: int) -> None:
        if cache.get_seq_length() > length:
            cache.crop(length - cache.get_seq_length())  # crop takes the count to remove

    def run(
        self, cache: DynamicCache, tokens: torch.Tensor, features: torch.Tensor, parents: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, n = cache.get_seq_length(), len(tokens)
        positions, mask = torch.arange(start, start + n, device=self.device), None
        if parents is not None:
            visible = tree_mask(n, parents).to(self.device)
            positions = tree_positions(start, visible)
            mask = torch.zeros(n, start + n, device=self.device, dtype=self.module.dtype)
            mask[:, start:].masked_fill_(~visible, torch.finfo(self.module.dtype).min)
            mask = mask[None, None]
        logits, out = head_forward(
            self.module, self.embed, tokens[None].to(self.device), features[None], positions[None], cache, mask
        )
        return logits[0], out[0]


class NativeHead(HeadRunner[PagedCache]):
    """The head on the native CPU runtime (models/native/): its layer, ``fc`` and output rows in the int8 kernels.

    As a transformers module one level of drafting is mostly framework time and slow skinny products over float32
    weights; here its int8 weights (a quarter of the bytes) are read once per level by the native kernels
    (benchmarks/eagle_head_cost.py measures both). Its numbers are int8's, not the module's: drafts differ a little,
    verification keeps the output exact.
    """

    def __init__(self, module: PreTrainedModel, embed: Embed) -> None:
        self.model = NativeModel.from_module(module)
        self.fc = PackedInt8(module.eagle_fc.weight.float())
        self.embed = embed
        self.keep_ids = module.keep_ids
        self.device = torch.device("cpu")
        self.max_position = self.model.shape.max_context
        self.identity = f"eagle head|native int8|{kernel_build.build_name()}|{model_identity(module)}"

    def new_cache(self) -> PagedCache:
        return native.new_cache(self.model)

    def length(self, cache: PagedCache) -> int:
        return cache.length

    def truncate(self, cache: PagedCache, length: int) -> None:
        cache.truncate(min(cache.length, length))

    def run(
        self, cache: PagedCache, tokens: torch.Tensor, features: torch.Tensor, parents: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = formats.linear(torch.cat([self.embed(tokens).float(), features.float()], dim=-1), self.fc)
        visible = None if parents is None else tree_mask(len(tokens), parents)
        logits, hidden = self.model.forward(x, cache, len(tokens), visible, features=True)
        return logits, hidden  # type: ignore[return-value]


def why_not_native(module: PreTrainedModel) -> str | None:
    """Why ``module`` cannot run as a :class:`NativeHead` here (a CPU with the kernels, a family the native runtime
    runs, widths the int8 kernel takes), or None when it can."""
    config = module.config
    widths = (
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads * module.model.layers[0].self_attn.head_dim,
    )
    if module.eagle_fc.weight.device.type != "cpu":
        return "the native runtime runs on the CPU"
    if reason := native.unsupported(config.get_text_config()):
        return reason
    return (
        None if all(w % 32 == 0 for w in widths) else f"the int8 kernels need widths in multiples of 32, not {widths}"
    )


class EagleDrafter(Drafter):
    """Drafts trees (or chains) with a feature-conditioned head; the engine hands it the target's hidden states every
    step.

    The head is not a Backend: timed runs learn its cost from drafting time, seeded runs price ``measure_step``. Its
    proposals carry scores, so the engine asks for the most nodes and keeps the ones worth verifying.
    """

    capabilities = DrafterCapabilities(trees=True, scores=True, features=True, measures_steps=True)

    def __init__(
        self,
        head: PreTrainedModel | HeadRunner,
        embed: Embed,
        full_vocab: int,
        max_depth: int = MAX_DEPTH,
        min_score: float = MIN_SCORE,
    ) -> None:
        """``head``: the head's module (run as such: ModuleHead) or what runs it."""
        self.runner: HeadRunner = ModuleHead(head, embed) if isinstance(head, PreTrainedModel) else head
        self.vocab_size: int | None = full_vocab
        self.max_depth, self.min_score = max_depth, min_score
        self.settings = DraftSettings()
        self.begin(self.settings)

    def begin(self, settings: DraftSettings) -> None:
        self.settings = settings
        self.cache = self.runner.new_cache()
        # context positions read: the head's cache holds their pairs (or, begun mid-sequence, the last of them)
        self.read = 0
        self.cached = 0  # entries of the head's cache that are context, not drafts
        # the target's, one [n, H] piece per step, for the positions after ``read``
        self.features: list[torch.Tensor] = []
        self.known = 0  # context positions whose target features arrived

    @property
    def identity(self) -> str:
        """The head and the runtime that runs it: what its measured step cost is cached under."""
        return self.runner.identity

    @torch.inference_mode()
    def measure_step(self, branches: int = 1, repeats: int = 9) -> float:
        """Median seconds of one draft step (one run of the head, with the distributions and top tokens read from it)
        after a MEASURE_CONTEXT-token context, drafting as the engine asks (the context's new pairs read, every level
        grown): a chain of MEASURE_LEVELS, or with ``branches`` a tree of that many nodes a level, as deep as the head
        grows trees (``max_depth``). What a seeded run prices a step at."""
        # every level grows
        probe = EagleDrafter(self.runner, self.runner.embed, self.vocab_size, self.max_depth, min_score=0.0)
        tokens = self.runner.keep_ids[: MEASURE_CONTEXT + repeats + 1].cpu()
        width = self.runner.embed(tokens[:1].to(self.runner.device)).shape[-1]
        probe.observe_features(torch.zeros(MEASURE_CONTEXT, width))
        probe.propose(tokens[: MEASURE_CONTEXT + 1], 1)  # reads the context, warms up
        times = []
        for length in range(MEASURE_CONTEXT + 2, MEASURE_CONTEXT + repeats + 2):
            probe.observe_features(torch.zeros(1, width))
            start = time.perf_counter()
            proposal = probe.propose(
                tokens[:length], MEASURE_LEVELS if branches == 1 else MEASURE_LEVELS * branches, branches
            )
            # its tokens reach the host: the work is done
            times.append((time.perf_counter() - start) / proposal.draft_steps)
        return statistics.median(times)

    def observe_features(self, features: torch.Tensor) -> None:
        """The target's final hidden states of the next context positions (those it cached this step)."""
        self.features.append(features.to(self.runner.device))
        self.known += len(features)

    def accept(self, n: int) -> None:
        pass  # the head re-reads the accepted tokens with the target's features at the next step

    def fork(self) -> EagleDrafter:
        return EagleDrafter(self.runner, self.runner.embed, self.vocab_size, self.max_depth, self.min_score)  # type: ignore[arg-type]

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        length = context.shape[0]
        # begun mid-sequence (a guard's anchor): read from the first position it has
        if self.read == 0 and 0 < self.known < length - 1:
            self.read = length - 1 - self.known
        if self.known == 0 or k < 1:  # the first step: the target has not read the prompt yet
            return Proposal.empty()
        # Read the new context pairs (f_t, x_{t+1}) with the target's features: their last output drafts x_length.
        features = torch.cat(self.features)[: length - 1 - self.read]
        self.features = []
        logits, out = self.runner.run(self.cache, context[self.read + 1 : length], features, None)
        self.read, self.cached = length - 1, self.runner.length(self.cache)
        return self._grow(logits[-1], out[-1], k, branches, length)

    def _grow(self, logits: torch.Tensor, feature: torch.Tensor, k: int, width: int, length: int) -> Proposal:
        """The k most likely nodes of a tree grown level by level, expanding the ``width`` most likely nodes of each
        level."""
        sampling = self.settings.sampling
        shape = (lambda z: torch.softmax(z.float(), dim=-1)) if sampling.greedy else (lambda z: to_probs(z, sampling))
        nodes: list[tuple[float, int, int]] = []  # (score, kept-vocabulary token, parent node), level by level
        # node -> the head's distribution after it and its output feature (-1: the context)
        after = {-1: (shape(logits), feature)}
        frontier = [-1]
        steps = 1  # runs of the head: the context's, then one per level expanded
        depth_limit = min(self.max_depth, k, self.runner.max_position - length)
        for depth in range(depth_limit):
            children = []
            for node in frontier:
                score, top = nodes[node][0] if node >= 0 else 1.0, after[node][0].topk(width)
                children += [
                    (score * p, t, node) for p, t in zip(top.values.tolist(), top.indices.tolist(), strict=True)
                ]
            children = [c for c in children if c[0] >= self.min_score]
            if not children:
                break
            start = len(nodes)
            nodes += children
            frontier = sorted(range(start, len(nodes)), key=lambda i: -nodes[i][0])[:width]
            if depth + 1 < depth_limit:
                after |= self._expand(frontier, nodes, after, shape)
                steps += 1
        # The k best nodes, best first (ties: shallower first): a node's score is its parent's times a probability, so a
        # parent always precedes its children and the engine may keep any prefix of them (CostModelK.tree_size).
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], i))[:k]
        index = {node: i for i, node in enumerate(order)}
        keep_ids = self.runner.keep_ids
        tokens = keep_ids[torch.tensor([nodes[i][1] for i in order], dtype=torch.long, device=keep_ids.device)].cpu()
        parents = torch.tensor([index[nodes[i][2]] if nodes[i][2] >= 0 else -1 for i in order], dtype=torch.long)
        scores = torch.tensor([nodes[i][0] for i in order])
        return Proposal(tokens, None, parents if width > 1 else None, scores, steps)

    def _expand(self, expand: list[int], nodes: list[tuple[float, int, int]], after: dict, shape) -> dict:
        """The head's distribution and output feature after each node of ``expand``.

        The nodes and their ancestors are run as one tree after the context (each sees the context and its own
        ancestors), then dropped from the head's cache: re-running an ancestor costs rows, not weights, and keeps
        one cache layout for both runners.
        """
        included: set[int] = set()
        for node in expand:
            while node >= 0 and node not in included:
                included.add(node)
                node = nodes[node][2]
        tree = sorted(included)  # parents before children: a parent's index is lower
        slot = {node: i for i, node in enumerate(tree)}
        parents = torch.tensor([slot.get(nodes[node][2], -1) for node in tree], dtype=torch.long)
        keep_ids = self.runner.keep_ids
        tokens = keep_ids[torch.tensor([nodes[node][1] for node in tree], device=keep_ids.device)]
        features = torch.stack([after[nodes[node][2]][1] for node in tree])
        logits, out = self.runner.run(self.cache, tokens, features, parents)
        self.runner.truncate(self.cache, self.cached)
        return {node: (shape(logits[slot[node]]), out[slot[node]]) for node in expand}


def load_eagle(
    folder: str | Path,
    embed: Embed,
    full_vocab: int,
    device: torch.device = torch.device("cpu"),
    dtype: torch.dtype = torch.float32,
    kernels: bool | None = None,
) -> EagleDrafter:
    """The head saved in ``folder`` by ``specdec distill --arch eagle``, on ``device``, drafting for a target with
    input embedding ``embed``.

    ``kernels``: run it on the native int8 kernels (None: wherever they run, see :func:`why_not_native`; False: as its
    module).
    """
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    keep_ids, rows = tensors.pop("keep_ids"), tensors.pop("lm_head.weight").to(dtype)
    if int(keep_ids.max()) >= full_vocab:
        raise ConfigError(
            f"eagle head '{folder}' was distilled for a target with another vocabulary: use it with its own target"
        )
    config = AutoConfig.from_pretrained(folder)
    head = eagle_skeleton(config, rows, keep_ids, config.num_hidden_layers)
    expected = {name for name, p in head.named_parameters() if p.requires_grad}
    missing = expected - set(tensors)
    unexpected = set(tensors) - expected
    if missing or unexpected:
        raise ConfigError(
            f"'{folder}' is not an eagle head of this version "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    head.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
    head.to(device)
    if embed(torch.zeros(1, dtype=torch.long, device=device)).shape[-1] != rows.shape[1]:
        raise ConfigError(
            f"eagle head '{folder}' has hidden size {rows.shape[1]}, unlike this target: use it with its own target"
        )
    head.eval()
    reason = why_not_native(head)
    if kernels and reason:
        raise ConfigError(f"eagle head '{folder}' cannot run on the native kernels here: {reason}")
    on_kernels = reason is None if kernels is None else kernels
    return EagleDrafter(NativeHead(head, embed) if on_kernels else head, embed, full_vocab)
