"""Drafters: cheap proposers of candidate tokens, all behind one contract (drafters.base.Drafter)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from functools import singledispatch

from specdec.config import RuntimeConfig
from specdec.drafters.base import Drafter, DrafterCapabilities, DraftSettings, Proposal
from specdec.drafters.cross_tokenizer import CrossTokenizerDrafter
from specdec.drafters.distilled import ReducedVocabBackend, is_distilled_draft, load_draft, read_meta
from specdec.drafters.eagle import EagleDrafter, load_eagle
from specdec.drafters.fallback import FallbackDrafter
from specdec.drafters.layer_skip import shallow_view
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter, NgramTable
from specdec.drafters.none import NoDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.drafters.suffix import SuffixDrafter, SuffixStore
from specdec.errors import ConfigError
from specdec.models import Target, TransformersBackend, open_target
from specdec.models.precision import convert_draft
from specdec.models.registry import bundled_draft

# drafter specs whose drafters learn from the sequences they have drafted (DrafterCapabilities.learns): a benchmark
# sends each prompt once to a fresh one
LEARNING_SPECS = ("suffix",)
# ``auto`` drafts with the eagle head where verifying 3 tokens costs at most this many steps and one of the head's
# draft steps at most this share of a step
AUTO_HEAD_MAX_VERIFY = 1.15
AUTO_HEAD_MAX_SHARE = 0.03
DRAFT_SPECS = (
    "auto (the default: lookup-then-eagle where an eagle head ships for the target, verifying 3 tokens costs "
    "about one step and the head's own step little beside it, otherwise suffix), none, prompt-lookup, "
    "lookup-then-draft (prompt lookup, then the "
    "distilled draft shipped for the target), suffix (what followed the context's longest match in this request and "
    "in earlier requests' answers), eagle (the eagle head shipped for the target), lookup-then-eagle "
    "(prompt lookup, then the eagle head; with branches both, merged into one tree), ngram:FILE (a table from "
    "`specdec ngram build`), layerskip:L (the target's first L layers), "
    "model:MODEL (transformers; a model with another tokenizer is re-tokenized; a folder from `specdec distill`), "
    "gguf:MODEL (llama.cpp)"
)


def drafter_name(spec: str | Drafter) -> str:
    """What drafts, in words: a spec as written, or a ready drafter's class."""
    return spec if isinstance(spec, str) else type(spec).__name__


@singledispatch
def build_drafter(spec: object, target: Target, runtime: RuntimeConfig = RuntimeConfig()) -> Drafter:
    """Build a drafter for ``target`` from its command-line spec (see DRAFT_SPECS); model drafts share the runtime
    settings. A ready :class:`Drafter` is returned as it is. One overload per declared spec type: a name or a
    Drafter; anything else is refused here."""
    raise ConfigError(
        f"a drafter is a name (see --draft) or an instance of specdec.drafters.Drafter, not {type(spec).__name__}: "
        "subclass Drafter (docs/writing-a-drafter.md)"
    )


@build_drafter.register(Drafter)
def _ready(spec: Drafter, target: Target, runtime: RuntimeConfig = RuntimeConfig()) -> Drafter:
    return spec


@build_drafter.register(str)
def _named(spec: str, target: Target, runtime: RuntimeConfig = RuntimeConfig()) -> Drafter:
    kind, _, arg = spec.partition(":")
    if spec == "auto":
        raise ConfigError(
            "'auto' is chosen from this machine's measured costs: pass it to Generator, which measures them, "
            "or name a drafter"
        )
    if spec == "none":
        return NoDrafter()
    if spec == "prompt-lookup":
        return PromptLookupDrafter()
    if spec == "suffix":
        return SuffixDrafter(SuffixStore())
    if kind == "ngram" and arg:
        return NgramDrafter(NgramTable.load(arg))
    if kind == "layerskip" and arg:
        if not arg.isdigit():
            raise ConfigError(f"layerskip:L needs a layer count, got '{arg}' (for example layerskip:6)")
        model = target.backend.transformers_model()
        if model is None:
            raise ConfigError("layerskip drafts with the target's own layers in torch: use --runtime transformers")
        return ModelDrafter(TransformersBackend(shallow_view(model, int(arg))))
    if spec == "default":
        warnings.warn(
            "the drafter 'default' is now called 'lookup-then-draft' (prompt lookup, then the distilled draft); "
            "'default' will be removed in the next release",
            FutureWarning,
            stacklevel=3,  # past the overload dispatch, to the caller
        )
        spec = "lookup-then-draft"
    if spec == "lookup-then-draft":
        folder = bundled_draft(target.name)
        if folder is None:
            raise ConfigError(
                f"no draft ships with specdec for '{target.name}' (one does for gemma-3-270m): distill one with "
                "`specdec distill` and pass --draft model:DIR, or use --draft prompt-lookup"
            )
        return FallbackDrafter(PromptLookupDrafter(), _distilled(str(folder), target, runtime))
    if spec in ("eagle", "lookup-then-eagle"):
        folder = bundled_draft(target.name, "eagle")
        if folder is None:
            raise ConfigError(
                f"no eagle head ships with specdec for '{target.name}' (one does for gemma-3-270m): train one with "
                "`specdec distill --arch eagle` and pass --draft model:DIR"
            )
        head = _eagle(str(folder), target)
        return head if spec == "eagle" else FallbackDrafter(PromptLookupDrafter(), head)
    if kind == "model" and is_distilled_draft(arg):
        return _eagle(arg, target) if read_meta(arg)["arch"].get("eagle") else _distilled(arg, target, runtime)
    if kind in ("model", "gguf") and arg:
        draft = open_target(
            arg, replace(runtime, backend="transformers" if kind == "model" else "llama.cpp", precision=None)
        )
        if runtime.precision is not None and kind == "model":
            model = draft.backend.model
            convert_draft(model, runtime.precision.draft)
            # a backend's ModelInfo is taken when it is built: one over the converted weights names their format
            draft = replace(draft, backend=TransformersBackend(model))
        if draft.backend.vocab_size == target.backend.vocab_size or draft.tokenizer is None or target.tokenizer is None:
            return ModelDrafter(draft.backend)  # the engine refuses a vocabulary mismatch it cannot re-tokenize
        return CrossTokenizerDrafter(draft.backend, draft.tokenizer, target.tokenizer, draft.eos_ids)
    raise ConfigError(f"unknown draft '{spec}': use one of {DRAFT_SPECS}")


def may_learn(spec: str) -> bool:
    """Whether the drafter a spec names may learn from the sequences it drafts: a learning spec, or ``auto``, which
    drafts with suffix on most machines."""
    return spec in LEARNING_SPECS or spec == "auto"


def auto_draft(
    target: Target, verify_cost: Callable[[], Callable[[int], float]], draft_cost: Callable[[Drafter], float]
) -> str:
    """What ``auto`` drafts with on ``target``: prompt lookup, then the shipped eagle head, where a head ships for it,
    its backend gives hidden states, verifying 3 tokens costs at most AUTO_HEAD_MAX_VERIFY one-token steps
    (``verify_cost()``: the target's forward cost over n tokens on this machine) and one of the head's draft steps
    (``draft_cost(head)``) at most AUTO_HEAD_MAX_SHARE of a one-token step; suffix elsewhere. Costs are asked for
    only where a head ships.

    The head's drafts are short (one or two accepted per step), so they pay only where verifying them is nearly free
    and drafting them is cheap beside a target step: on a slow target whose verification is flat (a transformers
    bfloat16 plan) it beats copying; on a fast one (native) its step costs too much of the target's and copying wins.
    Suffix drafting copies from the request itself as prompt lookup does, and also from earlier answers: it ties prompt
    lookup where text repeats within a request and wins where requests repeat each other (tool calls, house styles).
    """
    folder = bundled_draft(target.name, "eagle")
    if not target.backend.capabilities.features or folder is None:
        return "suffix"
    cost = verify_cost()
    if cost(3) > AUTO_HEAD_MAX_VERIFY * cost(1):
        return "suffix"
    return "lookup-then-eagle" if draft_cost(_eagle(str(folder), target)) <= AUTO_HEAD_MAX_SHARE * cost(1) else "suffix"


def _eagle(folder: str, target: Target) -> EagleDrafter:
    embeddings = target.backend.token_embeddings() if target.backend.capabilities.features else None
    if embeddings is None:
        raise ConfigError(
            "an eagle head drafts from the target's hidden states and embedding: "
            "use --runtime native, transformers or llama.cpp"
        )
    return load_eagle(folder, embeddings, target.backend.vocab_size, target.backend.device)


def _distilled(folder: str, target: Target, runtime: RuntimeConfig) -> ModelDrafter:
    model = target.backend.transformers_model()
    if model is None:
        raise ConfigError("a distilled draft runs on the target's own embedding in torch: use --runtime transformers")
    draft = load_draft(folder, model)
    # an exit draft's layers are the target's
    if runtime.precision is not None and not read_meta(folder)["arch"].get("exit"):
        convert_draft(draft, runtime.precision.draft)
    backend = ReducedVocabBackend(draft, target.backend.vocab_size)
    return ModelDrafter(backend, min_confidence=read_meta(folder).get("min_confidence", 0.0))


__all__ = [
    "DRAFT_SPECS",
    "LEARNING_SPECS",
    "CrossTokenizerDrafter",
    "EagleDrafter",
    "FallbackDrafter",
    "Drafter",
    "DrafterCapabilities",
    "DraftSettings",
    "ModelDrafter",
    "NgramDrafter",
    "NgramTable",
    "NoDrafter",
    "PromptLookupDrafter",
    "SuffixDrafter",
    "SuffixStore",
    "Proposal",
    "auto_draft",
    "may_learn",
    "build_drafter",
    "drafter_name",
]
