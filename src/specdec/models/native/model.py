"""The native runtime's forward pass for Gemma-3, Llama, Mistral and Qwen2/3 models, and its backends.

On a CPU, transformers verifies nine positions almost for the price of one but pays in framework time and kernels
made for other shapes; llama.cpp's step is fast but every extra position costs almost as much as the first. Here every
linear layer, the output head included, runs ``formats.linear`` (int8 or int4 weights, int8 activations, each weight
read from memory once per step whatever the number of positions) and attention runs its exact kernel; what is left
between them is a few dozen small tensor operations per layer.

A position's logits do not depend on how many positions are scored with it, nor on the thread count (integer
products, attention computed per position, row-wise norms and activations), so speculative greedy decoding on this
backend is token-identical to its own one-token decoding. Its numbers are not transformers' float32 ones: the formats
round weights and activations, and beside int4 weights the KV cache keeps bfloat16 keys and values (each format's
perplexity against float32 is measured in the benchmarks).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdec.errors import ConfigError
from specdec.models.backend import (
    Backend,
    BackendCapabilities,
    Embed,
    ModelInfo,
    OneRow,
    PackedWeights,
    RowBackend,
    tree_mask,
    tree_positions,
)
from specdec.models.mkl import settle_mkl_functions
from specdec.models.native import formats, kernel_build, ops, paged_cache
from specdec.models.native.formats import FORMATS, Packed, PackedInt8
from specdec.models.native.paged_cache import PagedCache

log = logging.getLogger("specdec")
FAMILIES = ("gemma3_text", "llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # tables fixed at load (dynamic and longrope vary with length)
FIRST_CAPACITY = 256  # positions of the rotary tables at first; doubled as the text grows


@dataclass(frozen=True)
class Shape:
    """What the forward pass needs to know about a model besides its weights."""

    family: str
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float  # attention scores' factor
    windows: tuple[int, ...]  # per layer: sliding window in positions, 0 = every earlier position
    rotary: tuple[str, ...]  # per layer: which of the model's rotary tables (its layer type; "" for one table)
    qk_norm: bool  # an RMS norm over each head's queries and keys (Gemma-3, Qwen3)
    embed_scale: float
    softcap: float | None  # final logits' tanh cap
    max_context: int


@dataclass(frozen=True)
class Part:
    """One sequence's share of a forward: its new tokens (ids [n], or input vectors [n, H]), its cache, and for a tree
    of drafts at the end, which new positions each one sees (bool [n, n], ``backend.tree_mask``)."""

    tokens: torch.Tensor
    cache: PagedCache
    visible: torch.Tensor | None = None


@dataclass
class Layer:
    qkv: Packed
    out: Packed
    gate_up: Packed
    down: Packed
    norms: dict[str, torch.Tensor]  # float32 weights, Gemma's already as 1 + w
    biases: dict[str, torch.Tensor]  # float32, for the linear layers that have one (Qwen2's qkv)


LINEARS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "out": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
Tensors = Callable[[str], "torch.Tensor | None"]  # a checkpoint's tensor by its transformers name, None if it has none


class NativeModel:
    """The weights of one model in the native runtime's formats; shared by every backend (cache) over it.

    Built by :meth:`convert` from a checkpoint's tensors, one at a time (so memory stays near the converted model's
    size), or restored by :meth:`restore` from :meth:`state` (whose tensors may be memory-mapped from a file).
    """

    def __init__(
        self,
        shape: Shape,
        name: str,
        embedding: torch.Tensor | None,
        layers: list[Layer],
        final_norm: torch.Tensor,
        head: Packed,
        weights: int,
        inverse: dict[str, tuple[torch.Tensor, float]],
        format: str,
    ) -> None:
        self.shape, self.name, self.embedding, self.layers = shape, name, embedding, layers
        self.final_norm, self.head, self.weights = final_norm, head, weights
        self.vocab_size = head.out_features
        self.format = format  # of the layers' weights; the output head is always int8
        self._inverse = inverse  # per rotary table: inverse frequencies and the cos/sin scale
        # each table's rows are computed once, here (in the loading thread) and as the text grows, never again: a
        # position's cos and sin keep their bits for the model's life, whichever thread first reaches it
        self._growing = threading.Lock()
        settle_mkl_functions()  # cos and sin: their first calls must not be the table's, split among threads
        self._rotary = {name: _rotary_rows(0, FIRST_CAPACITY, *self._inverse[name]) for name in self._inverse}

    @classmethod
    def convert(
        cls, config, tensors: Tensors, format: str = "int8", progress: Callable[[int, int], None] | None = None
    ):
        """Pack a checkpoint's weights (``tensors``, fetched one at a time) into ``format`` (int8 or int4). The output
        head stays int8 in either (as llama.cpp's 4-bit mixes keep theirs at 6-8 bits): 4-bit logits cost too much."""
        if format not in FORMATS:
            raise ConfigError(f"unknown native format {format!r}: use one of {', '.join(FORMATS)}")
        pack = FORMATS[format]
        shape = _shape(config)
        gemma = shape.family == "gemma3_text"
        offset = 1.0 if gemma else 0.0  # Gemma's norms multiply by (1 + w)
        counted = [0]

        def fetch(name: str, required: bool = True) -> torch.Tensor | None:
            tensor = tensors(name)
            if tensor is None and required:
                raise ConfigError(f"the checkpoint has no tensor {name!r}: use --runtime transformers")
            counted[0] += 0 if tensor is None else tensor.numel()
            return tensor

        source = fetch("model.embed_tokens.weight", required=False)  # an eagle head has none: it is fed vectors
        head = fetch("lm_head.weight", required=not config.tie_word_embeddings)
        if head is None and source is None:
            raise ConfigError(
                "the checkpoint has neither an output head nor an input embedding: use --runtime transformers"
            )
        head = PackedInt8(source if head is None else head)  # tied: the output head is the input embedding
        embedding = None if source is None else source.to(torch.bfloat16)
        del source  # packed first, so only one copy of the largest matrix is ever held
        layers = []
        for index in range(config.num_hidden_layers):
            prefix = f"model.layers.{index}."
            names = ["input_layernorm", "post_attention_layernorm"]
            names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if gemma else []
            names += ["self_attn.q_norm", "self_attn.k_norm"] if shape.qk_norm else []
            norms = {n.split(".")[-1]: fetch(f"{prefix}{n}.weight").float() + offset for n in names}
            packed, biases = {}, {}
            for part, linears in LINEARS.items():
                where = "mlp" if part in ("gate_up", "down") else "self_attn"
                weights = [fetch(f"{prefix}{where}.{lin}.weight") for lin in linears]
                packed[part] = pack(torch.cat(weights) if len(weights) > 1 else weights[0])
                bias = [fetch(f"{prefix}{where}.{lin}.bias", required=False) for lin in linears]
                if any(b is not None for b in bias):
                    zeros = [torch.zeros(len(w)) for w in weights]
                    biases[part] = torch.cat([z if b is None else b.float() for b, z in zip(bias, zeros, strict=True)])
                del weights
            layers.append(Layer(**packed, norms=norms, biases=biases))
            if progress is not None:
                progress(index + 1, config.num_hidden_layers)
        final_norm = fetch("model.norm.weight").float() + offset
        name = f"{config.name_or_path or config.model_type}"
        return cls(
            shape, name, embedding, layers, final_norm, head, counted[0], _rotary_frequencies(config, shape), format
        )

    @classmethod
    def from_module(cls, model: PreTrainedModel, format: str = "int8") -> NativeModel:
        """Convert a transformers model already in memory."""
        state = model.state_dict()
        model_native = cls.convert(model.config.get_text_config(), lambda name: state.get(name), format)
        model_native.weights = sum(p.numel() for p in model.parameters())
        return model_native

    def state(self) -> dict:
        """The weights and what names them, in plain containers (``torch.save`` writes it; :meth:`restore` reads it)."""
        layers = [
            {"norms": layer.norms, "biases": layer.biases} | {part: getattr(layer, part).state() for part in LINEARS}
            for layer in self.layers
        ]
        return {
            "name": self.name,
            "embedding": self.embedding,
            "layers": layers,
            "final_norm": self.final_norm,
            "head": self.head.state(),
            "weights": self.weights,
            "format": self.format,
        }

    @classmethod
    def restore(cls, state: dict, config) -> NativeModel:
        """The model :meth:`state` wrote, for the checkpoint of this (text) ``config``: its shape and rotary tables
        are derived from the config again, the weights come from the state."""
        shape = _shape(config)
        layers = [
            Layer(
                **{part: Packed.restore(layer[part]) for part in LINEARS}, norms=layer["norms"], biases=layer["biases"]
            )
            for layer in state["layers"]
        ]
        head, inverse = Packed.restore(state["head"]), _rotary_frequencies(config, shape)
        weights, format = state["weights"], state["format"]
        return cls(
            shape, state["name"], state["embedding"], layers, state["final_norm"], head, weights, inverse, format
        )

    def forward(
        self,
        tokens: torch.Tensor,
        cache: PagedCache,
        last: int,
        visible: torch.Tensor | None = None,
        features: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [last, V] of the last ``last`` of ``tokens`` [n], appended to ``cache`` at its length; with
        ``features`` also every position's final hidden state [n, H] (what the output head reads), else None.
        ``tokens`` may also be the input vectors themselves [n, H] (what a feature-conditioned head feeds its layer).

        ``visible`` (bool [n, n], ``backend.tree_mask``) makes the new tokens a tree: each at the position of its depth,
        seeing only its ancestors among them.
        """
        logits, hidden = self.forward_parts([Part(tokens, cache, visible)], [last], features)
        return logits, hidden[0] if hidden is not None else None

    def forward_parts(
        self, parts: list[Part], last: list[int], features: bool = False, argmax: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """One forward over several sequences' new tokens, each appended to its own cache: logits [sum(last), V], part
        i's last ``last[i]`` positions after part i - 1's, and with ``features`` each part's final hidden states
        [n_i, H]. ``argmax``: instead of the logits, each of those positions' argmax [sum(last)] (the first index of
        its largest logit), which the output head then computes without writing the logits.

        Every operation but attention works position by position (a position's numbers do not depend on the others
        in the forward), so the weights are read once for all parts and each part's logits are those it would get
        alone; attention runs per part, over its own cache.
        """
        shape = self.shape
        gemma = shape.family == "gemma3_text"  # a norm after each block and one before the MLP; GELU, not SiLU
        sizes = [len(part.tokens) for part in parts]
        if any(not 0 < count <= n for count, n in zip(last, sizes, strict=True)):
            raise ValueError(f"the logits asked for ({last}) must be 1 to the positions of each part ({sizes})")
        starts = [part.cache.length for part in parts]
        ends = torch.tensor(sizes).cumsum(0).tolist()
        for part, start, n in zip(parts, starts, sizes, strict=True):
            part.cache.reserve(start + n)
        x = torch.cat([self.embed(part.tokens) if part.tokens.dim() == 1 else part.tokens.float() for part in parts])
        positions = [
            torch.arange(start, start + n) if part.visible is None else tree_positions(start, part.visible)
            for part, start, n in zip(parts, starts, sizes, strict=True)
        ]
        everywhere = torch.cat(positions)
        rotary = {table: self._cos_sin(table, everywhere) for table in set(shape.rotary)}
        q_width, kv_width, total = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, len(x)
        for index, layer in enumerate(self.layers):
            norms = layer.norms
            normed = ops.rms_norm(x, norms["input_layernorm"], shape.eps)
            qkv = _linear(normed, layer.qkv, layer.biases.get("qkv"))
            q, k, v = qkv.split([q_width, kv_width, kv_width], dim=1)
            q, k = q.view(total, shape.heads, -1), k.view(total, shape.kv_heads, -1)
            v = v.view(total, shape.kv_heads, -1)
            if "q_norm" in norms:
                q = ops.rms_norm(q, norms["q_norm"], shape.eps)
                k = ops.rms_norm(k, norms["k_norm"], shape.eps)
            cos, sin = rotary[shape.rotary[index]]
            q, k = ops.rotate(q, cos, sin), ops.rotate(k, cos, sin)
            window = shape.windows[index]
            attended = [
                ops.attention(
                    q[end - n : end], k[end - n : end], v[end - n : end], part.cache, index, start, window,
                    shape.scale, part.visible, where,
                )
                for part, start, n, end, where in zip(parts, starts, sizes, ends, positions, strict=True)
            ]  # fmt: skip
            joined = attended[0] if len(attended) == 1 else torch.cat(attended)
            out = _linear(joined.view(total, q_width), layer.out, layer.biases.get("out"))
            if gemma:
                x = x + ops.rms_norm(out, norms["post_attention_layernorm"], shape.eps)
                h = ops.rms_norm(x, norms["pre_feedforward_layernorm"], shape.eps)
            else:
                x = x + out
                h = ops.rms_norm(x, norms["post_attention_layernorm"], shape.eps)
            gated = ops.gated(_linear(h, layer.gate_up, layer.biases.get("gate_up")), gelu=gemma)
            out = _linear(gated, layer.down, layer.biases.get("down"))
            if gemma:
                out = ops.rms_norm(out, norms["post_feedforward_layernorm"], shape.eps)
            x = x + out
        for part, start, n in zip(parts, starts, sizes, strict=True):
            part.cache.length = start + n
        # The output head reads each part's last positions only (all of them when their hidden states are wanted).
        read = [torch.arange(end - count, end) for end, count in zip(ends, last, strict=True)]
        rows = read[0] if len(read) == 1 else torch.cat(read)
        if features:
            hidden = ops.rms_norm(x, self.final_norm, shape.eps)
            head_in = hidden[rows].contiguous()
        else:
            hidden = None
            head_in = ops.rms_norm(x[rows].contiguous(), self.final_norm, shape.eps)
        if argmax and shape.softcap is None:
            out = formats.linear_argmax(head_in, self.head)
        else:
            out = formats.linear(head_in, self.head)
            if shape.softcap is not None:  # part by part: an element-wise kernel's bits may depend on where a run ends
                capped = [torch.tanh(part / shape.softcap) * shape.softcap for part in out.split(last)]
                out = capped[0] if len(capped) == 1 else torch.cat(capped)
            if argmax:  # the capped logits' (tanh may round neighbours to one value: its first index then)
                out = out.max(dim=-1).indices
        if hidden is None:
            return out, None
        return out, [hidden[end - n : end] for end, n in zip(ends, sizes, strict=True)]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embedding of ``tokens`` (float32, scaled as the model scales it)."""
        return self.embedding[tokens.cpu()].float() * self.shape.embed_scale

    def _cos_sin(self, name: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary cos and sin [n, 1, head_dim] for ``positions``, from a table grown as the cache grows (as transformers
        computes them: float32 angles, position times inverse frequency, then cos and sin times the type's scale)."""
        wanted = int(positions.max()) + 1
        if self._rotary[name][0].shape[0] < wanted:
            with self._growing:  # one thread computes the new rows; the rows already there are kept as they are
                cos, sin = self._rotary[name]
                if cos.shape[0] < wanted:
                    more = _rotary_rows(cos.shape[0], max(2 * cos.shape[0], 2 * wanted), *self._inverse[name])
                    self._rotary[name] = (torch.cat([cos, more[0]]), torch.cat([sin, more[1]]))
        cos, sin = self._rotary[name]
        return cos[positions, None], sin[positions, None]


def _rotary_rows(start: int, end: int, inverse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos and sin rows for positions start .. end - 1 (float32 angles, position times inverse frequency)."""
    angles = torch.arange(start, end, dtype=torch.float32)[:, None] * inverse[None]
    angles = torch.cat([angles, angles], dim=1)
    return angles.cos() * scale, angles.sin() * scale


def new_cache(model: NativeModel, dtype: str | None = None) -> PagedCache:
    """An empty KV cache for one sequence of ``model`` in ``dtype`` (float32, bfloat16 or float16). By default it
    follows the weights: float32 beside int8 (the format closest to float32, for models the caches hold), bfloat16
    beside int4 (large, memory-bound models, where the cache's bytes count)."""
    shape = model.shape
    dtype = dtype or ("bfloat16" if model.format == "int4" else "float32")
    return PagedCache(shape.windows, shape.kv_heads, shape.head_dim, dtype)


class NativeBackend(Backend):
    """A single-sequence :class:`~specdec.models.backend.Backend` over a :class:`NativeModel`: one sequence runs
    through OneRow over its cache, a batch on :class:`NativeRows` over the same weights."""

    def __init__(self, model: NativeModel, cache_dtype: str | None = None) -> None:
        self.model = model
        self.cache = new_cache(model, cache_dtype)
        self.info = native_info(model, self.cache.dtype)
        self.last_features: torch.Tensor | None = None

    def row_backend(self, *, batch: bool, trees: bool = False, cuda_graphs: bool = True) -> RowBackend:
        return NativeRows(self.model, self.cache.dtype) if batch else OneRow(self)

    @property
    def cached_length(self) -> int:
        return self.cache.length

    def fork(self) -> NativeBackend:
        return NativeBackend(self.model, self.cache.dtype)

    def token_embeddings(self) -> Embed:
        """The model's input embedding as a function of token ids (a feature-conditioned draft embeds with it)."""
        return self.model.embed

    def packed_weights(self) -> PackedWeights:
        return PackedWeights(self.model.format, self.model.weights)

    def reset(self) -> None:
        self.cache.truncate(0)

    def forward(
        self, tokens: torch.Tensor, last: int | None = None, tree: torch.Tensor | None = None, features: bool = False
    ) -> torch.Tensor:
        return self._forward(tokens, last, tree, features, argmax=False)

    def forward_argmax(
        self, tokens: torch.Tensor, last: int | None = None, tree: torch.Tensor | None = None, features: bool = False
    ) -> torch.Tensor:
        return self._forward(tokens, last, tree, features, argmax=True)

    @torch.inference_mode()
    def _forward(
        self, tokens: torch.Tensor, last: int | None, tree: torch.Tensor | None, features: bool, argmax: bool
    ) -> torch.Tensor:
        batch, n = tokens.shape
        if batch != 1:
            raise ConfigError(
                "a NativeBackend holds one sequence: decode batches on its row_backend(batch=True) (NativeRows)"
            )
        if self.cache.length + n > self.max_context:
            raise ValueError(f"{self.cache.length + n} positions exceed the model's context of {self.max_context}")
        visible = None if tree is None else tree_mask(n, tree)
        parts = [Part(tokens[0].cpu(), self.cache, visible)]
        out, hidden = self.model.forward_parts(parts, [last or n], features, argmax)
        self.last_features = None if hidden is None else hidden[0][None]
        return out[None]

    def truncate(self, length: int, branch: list[int] | None = None) -> None:
        self.cache.truncate(length, branch)


class NativeRows(RowBackend):
    """Sequences decoded together on a :class:`NativeModel`, each in a paged KV cache of its own that grows with it and
    is freed when it leaves: one forward for all rows reads the weights once, and each row's logits are bit for bit
    those it gets alone."""

    def __init__(self, model: NativeModel, cache_dtype: str | None = None) -> None:
        self.model = model
        self.cache_dtype = new_cache(model, cache_dtype).dtype
        self.info = native_info(model, self.cache_dtype, runtime="rows|", copies_rows=True)
        self.caches: list[PagedCache] = []
        self.last_features: list[torch.Tensor] = []

    @property
    def cached_lengths(self) -> list[int]:  # type: ignore[override]
        return [cache.length for cache in self.caches]

    def add_rows(self, count: int) -> None:
        self.caches += [new_cache(self.model, self.cache_dtype) for _ in range(count)]

    def remove_rows(self, row_ids: list[int]) -> None:
        gone = set(row_ids)
        self.caches = [cache for i, cache in enumerate(self.caches) if i not in gone]

    def forward(
        self,
        row_ids: list[int],
        feeds: list[torch.Tensor],
        last: int,
        trees: list[torch.Tensor | None] | None = None,
        features: bool = False,
    ) -> torch.Tensor:
        return self._forward(row_ids, feeds, last, trees, features, argmax=False)

    def forward_argmax(
        self,
        row_ids: list[int],
        feeds: list[torch.Tensor],
        last: int,
        trees: list[torch.Tensor | None] | None = None,
        features: bool = False,
    ) -> torch.Tensor:
        return self._forward(row_ids, feeds, last, trees, features, argmax=True)

    @torch.inference_mode()
    def _forward(
        self,
        row_ids: list[int],
        feeds: list[torch.Tensor],
        last: int,
        trees: list[torch.Tensor | None] | None,
        features: bool,
        argmax: bool,
    ) -> torch.Tensor:
        trees = trees or [None] * len(feeds)
        parts = []
        for row_id, feed, tree in zip(row_ids, feeds, trees, strict=True):
            cache = self.caches[row_id]
            if cache.length + len(feed) > self.max_context:
                raise ValueError(
                    f"row {row_id}: {cache.length + len(feed)} positions exceed "
                    f"the model's context of {self.max_context}"
                )
            parts.append(Part(feed.cpu(), cache, None if tree is None else tree_mask(len(feed), tree)))
        counts = [min(last, len(feed)) for feed in feeds]
        scores, hidden = self.model.forward_parts(parts, counts, features, argmax)
        self.last_features = hidden if hidden is not None else []
        width = () if argmax else (self.vocab_size,)  # argmax: one token per position
        if all(count == last for count in counts):  # a view: the rows' scores already lie one after another
            return scores.reshape(len(feeds), last, *width)
        out = scores.new_empty(len(feeds), last, *width)  # right-aligned after zeroed padding
        for i, (rows, count) in enumerate(zip(scores.split(counts), counts, strict=True)):
            out[i, : last - count] = 0
            out[i, last - count :] = rows
        return out

    def truncate(self, row_id: int, length: int, branch: list[int] | None = None) -> None:
        self.caches[row_id].truncate(length, branch)

    @torch.inference_mode()
    def copy_row(self, source: int, targets: list[int]) -> None:
        for target in targets:
            self.caches[target] = self.caches[source].copy()

    def kv_bytes(self) -> int:
        return sum(cache.nbytes for cache in self.caches)

    def kv_bytes_for(self, positions: int) -> int:
        shape, element = self.model.shape, getattr(torch, self.cache_dtype).itemsize
        page = 2 * shape.kv_heads * paged_cache.PAGE * shape.head_dim * element
        pages = -(-positions // paged_cache.PAGE)  # whole pages; a windowed layer releases those its window left
        return page * sum(min(pages, window // paged_cache.PAGE + 3) if window else pages for window in shape.windows)


def native_info(model: NativeModel, cache_dtype: str, runtime: str = "", copies_rows: bool = False) -> ModelInfo:
    """The record of a native model on a runtime named ``runtime`` (a prefix of its name). Its name: what decides its
    speed apart from threads (its weights and format, the KV cache's type, the kernels' build, chosen once a
    process)."""
    return ModelInfo(
        name=f"{runtime}native|{model.name}|{model.weights}|{model.format}|kv={cache_dtype}|"
        f"{kernel_build.build_name()}|cpu",
        vocab_size=model.vocab_size,
        max_context=model.shape.max_context,
        capabilities=BackendCapabilities(trees=True, features=True, max_rows=None, copies_rows=copies_rows),
    )


def unsupported(config) -> str | None:
    """Why the native backend cannot run a model of this (text) config on this machine (naming the fix), or None."""
    try:
        _shape(config)
    except ConfigError as exc:
        return str(exc)
    if (problem := kernel_build.kernels_problem()) is not None:
        return (
            "the native backend needs a CPU with AVX2 (x86) or SDOT (ARM) and a C++ compiler (g++) for its kernels, "
            f"and {problem}: use --runtime transformers --precision cpu (`specdec doctor` says more)"
        )
    return None


def _shape(config) -> Shape:
    family = config.model_type
    if family not in FAMILIES:
        runs = ", ".join(FAMILIES)
        raise ConfigError(f"the native backend runs {runs} models, not '{family}': use --runtime transformers")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = config.num_hidden_layers
    gemma = family == "gemma3_text"
    types = getattr(config, "layer_types", None)  # Mistral has none: its sliding window, if any, is every layer's
    if types is None:
        types = ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"] * layers
    if unknown := set(types) - {"sliding_attention", "full_attention"}:
        raise ConfigError(
            f"the native backend runs full and sliding-window attention, not {sorted(unknown)}: "
            "use --runtime transformers"
        )
    windows = tuple(config.sliding_window if t == "sliding_attention" else 0 for t in types)
    ropes = {t: config.rope_parameters[t] for t in set(types)} if gemma else {"": config.rope_parameters or {}}
    for rope in ropes.values():
        if (kind := rope.get("rope_type", "default")) not in ROPE_TYPES:
            kinds = ", ".join(ROPE_TYPES)
            raise ConfigError(
                f"the native backend's rotary embeddings are {kinds}, not {kind!r}: use --runtime transformers"
            )
        if (part := rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ConfigError(
                f"the native backend rotates whole heads, not a share of {part}: use --runtime transformers"
            )
    if gemma:
        scale, embed_scale, softcap = (
            config.query_pre_attn_scalar**-0.5,
            config.hidden_size**0.5,
            config.final_logit_softcapping,
        )
        if config.attn_logit_softcapping is not None:
            raise ConfigError("the native backend does not cap attention logits: use --runtime transformers")
    else:
        if config.hidden_act != "silu":
            act = config.hidden_act
            raise ConfigError(f"the native backend's MLP is SwiGLU, not {act!r}: use --runtime transformers")
        scale, embed_scale, softcap = head_dim**-0.5, 1.0, None
    if head_dim % 16:
        raise ConfigError(
            f"the native backend needs a head size that is a multiple of 16, not {head_dim}: use --runtime transformers"
        )
    widths = {
        "hidden": config.hidden_size,
        "FFN": config.intermediate_size,
        "attention": config.num_attention_heads * head_dim,
    }
    if odd := {name: width for name, width in widths.items() if width % 32}:
        shown = ", ".join(f"{name} {width}" for name, width in odd.items())
        raise ConfigError(f"the native formats need widths in multiples of 32, not {shown}: use --runtime transformers")
    return Shape(
        family=family,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        eps=config.rms_norm_eps,
        scale=scale,
        windows=windows,
        rotary=tuple(types) if gemma else ("",) * layers,
        qk_norm=family in ("gemma3_text", "qwen3"),
        embed_scale=embed_scale,
        softcap=softcap,
        max_context=getattr(config, "max_position_embeddings", None) or 2**31,
    )


def _rotary_frequencies(config, shape: Shape) -> dict[str, tuple[torch.Tensor, float]]:
    """Each rotary table's inverse frequencies and cos/sin scale, from the config as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    tables = {}
    for name in set(shape.rotary):
        rope = config.rope_parameters[name] if name else config.rope_parameters
        kind = rope.get("rope_type", "default")
        if kind == "default":
            dim = shape.head_dim
            inverse = 1.0 / (float(rope["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            tables[name] = (inverse, 1.0)
        else:
            inverse, scale = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"), layer_type=name or None)
            tables[name] = (inverse.float(), float(scale))
    return tables


def _linear(x: torch.Tensor, weights: Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """A packed linear layer plus its bias if it has one (an add per element: exact in any grouping)."""
    out = formats.linear(x, weights)
    return out if bias is None else out + bias
