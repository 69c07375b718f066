"""Each backend's ModelInfo: one frozen record behind its vocabulary, context, device and capabilities, and an
identity that follows torch's thread count."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import char_tokenizer, tiny_llama

from specdec.config import PRESETS, RuntimeConfig
from specdec.drafters import build_drafter
from specdec.drafters.distilled import ReducedVocabBackend
from specdec.models import Target, TransformersBackend
from specdec.models.backend import BackendCapabilities, Described, ModelInfo
from specdec.models.native import NativeBackend, NativeModel, kernel_build

needs_kernels = pytest.mark.skipif(kernel_build.compiled() is None, reason="the native backend needs AVX2 and g++")


def reduced() -> ReducedVocabBackend:
    model = tiny_llama(0, vocab=40)
    model.keep_ids = torch.arange(40)
    return ReducedVocabBackend(model, 96)


BACKENDS = {
    "transformers": lambda: TransformersBackend(tiny_llama(0)),
    "transformers one row": lambda: TransformersBackend(tiny_llama(0)).row_backend(batch=False),
    "batched": lambda: TransformersBackend(tiny_llama(0)).row_backend(batch=True),
    "reduced vocabulary": reduced,
    "native": lambda: NativeBackend(NativeModel.from_module(tiny_llama(3, hidden=64, context=1024))),
    "native one row": lambda: NativeBackend(NativeModel.from_module(tiny_llama(3, hidden=64))).row_backend(batch=False),
    "native rows": lambda: NativeBackend(NativeModel.from_module(tiny_llama(3, hidden=64))).row_backend(batch=True),
}
KINDS = [pytest.param(kind, marks=[needs_kernels] if "native" in kind else []) for kind in BACKENDS]


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("kind", KINDS)
def test_a_backends_info_is_its_properties_frozen_and_its_identity_follows_threads(kind: str, threads) -> None:
    backend = BACKENDS[kind]()
    info = backend.info
    assert isinstance(info, ModelInfo)
    got = (backend.vocab_size, backend.max_context, backend.device, backend.capabilities)
    assert got == (info.vocab_size, info.max_context, info.device, info.capabilities)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.vocab_size = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        backend.vocab_size = 1  # type: ignore[misc]
    for count in (1, 2):
        torch.set_num_threads(count)
        assert backend.identity == f"{info.name}|threads={count}"


def test_a_runtime_with_threads_of_its_own_is_keyed_by_its_name_alone(threads) -> None:
    """llama.cpp's thread pool is fixed when it is built and named in its record: torch's thread count is no part of
    its identity."""

    class OwnThreads(Described):
        info = ModelInfo("llama.cpp|model.gguf|threads=4", vocab_size=8, max_context=16, torch_threads=False)

    for count in (1, 2):
        torch.set_num_threads(count)
        assert OwnThreads().identity == "llama.cpp|model.gguf|threads=4"


def test_the_records_say_what_each_backend_is() -> None:
    target = TransformersBackend(tiny_llama(0))
    one_row, batched = target.row_backend(batch=False), target.row_backend(batch=True)
    assert target.capabilities == BackendCapabilities(trees=True, features=True, max_rows=None)
    one = dataclasses.replace(target.capabilities, max_rows=1)
    assert one_row.info == dataclasses.replace(target.info, capabilities=one)
    # the batched rows also copy one another's caches (rows with one prompt read it once)
    copies = dataclasses.replace(target.capabilities, copies_rows=True)
    assert batched.info.name == f"batched|{target.info.name}" and batched.capabilities == copies
    assert (target.vocab_size, target.max_context) == (96, 256)
    draft = reduced()
    assert (draft.vocab_size, draft.capabilities) == (96, BackendCapabilities())
    assert draft.fork().info == draft.info


def test_a_draft_converted_to_the_plans_format_is_keyed_by_it(tiny_folder) -> None:
    tokenizer = char_tokenizer()
    target = Target("tiny", TransformersBackend(tiny_llama(1, vocab=len(tokenizer))), tokenizer, frozenset({2}))
    drafter = build_drafter(f"model:{tiny_folder}", target, RuntimeConfig(precision=PRESETS["fp8-draft"]))
    assert "|float8|" in drafter.backend.identity
