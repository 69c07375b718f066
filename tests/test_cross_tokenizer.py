"""A draft with another tokenizer (SmolLM2 for Gemma and the reverse): token boundaries and greedy identity."""

from __future__ import annotations

import pytest
import torch

from specdec import Generator
from specdec.drafters import CrossTokenizerDrafter, DraftSettings
from specdec.errors import ConfigError
from specdec.models import load_model, open_target

pytestmark = pytest.mark.real_model

CHAT = "<start_of_turn>user\nName three colours.<end_of_turn>\n<start_of_turn>model\n"
PROMPTS = [
    "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n",
    CHAT,
    "The capital of Fra",  # ends mid-word: the draft's next token straddles the target's token boundary
    "北京是中国的首都。上海是",
]


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def gemma_with_smollm(gemma):
    return Generator(gemma, "model:smollm2-135m-instruct")


def test_a_draft_with_another_tokenizer_is_re_tokenized(gemma_with_smollm) -> None:
    assert isinstance(gemma_with_smollm.drafter, CrossTokenizerDrafter)


@pytest.mark.slow
def test_gemma_with_smollm_draft_is_identical_to_greedy(gemma, gemma_with_smollm) -> None:
    baseline = Generator(gemma, "none")
    accepted = 0
    for prompt in PROMPTS:
        expected = baseline.generate(prompt, max_new_tokens=20)
        got = gemma_with_smollm.generate(prompt, max_new_tokens=20, k=4, k_policy="fixed")
        assert got.token_ids == expected.token_ids, prompt
        accepted += got.stats.draft_tokens_accepted
    assert accepted > 0


@pytest.mark.parametrize("prompt", PROMPTS, ids=["code-whitespace", "special-tokens", "mid-word", "chinese"])
def test_proposals_spell_what_the_draft_wrote(gemma, smollm, gemma_with_smollm, prompt: str) -> None:
    """Appending the proposal to the context adds a prefix of the draft's own greedy text, without special tokens."""
    drafter = gemma_with_smollm.drafter
    ids = gemma.tokenizer(prompt)["input_ids"]
    drafter.begin(DraftSettings())
    proposal = drafter.propose(torch.tensor(ids), 6).tokens.tolist()
    assert proposal, "the draft should propose something here"
    assert not set(proposal) & set(gemma.tokenizer.all_special_ids)
    context_text = gemma.tokenizer.decode(ids, skip_special_tokens=True)
    joined = gemma.tokenizer.decode(ids + proposal, skip_special_tokens=True)
    assert joined.startswith(context_text)
    draft_ids = smollm.tokenizer(context_text, return_tensors="pt")["input_ids"]
    own = smollm.model.generate(draft_ids, attention_mask=torch.ones_like(draft_ids), max_new_tokens=8, do_sample=False)
    draft_text = smollm.tokenizer.decode(own[0], skip_special_tokens=True)[
        len(smollm.tokenizer.decode(draft_ids[0], skip_special_tokens=True)) :
    ]
    assert draft_text.startswith(joined[len(context_text) :]), (joined[len(context_text) :], draft_text)


def test_smollm_with_gemma_draft_is_identical_to_greedy(gemma, smollm) -> None:
    target = open_target(smollm)
    draft = open_target(gemma)
    drafter = CrossTokenizerDrafter(draft.backend, draft.tokenizer, smollm.tokenizer, draft.eos_ids)
    baseline, drafted = Generator(target, "none"), Generator(target, drafter)
    for prompt in PROMPTS[:3]:
        expected = baseline.generate(prompt, max_new_tokens=16)
        got = drafted.generate(prompt, max_new_tokens=16, k=4, k_policy="fixed")
        assert got.token_ids == expected.token_ids, prompt


def test_sampling_with_another_tokenizer_is_refused(gemma_with_smollm) -> None:
    with pytest.raises(ConfigError, match="greedy"):
        gemma_with_smollm.generate("Hello", max_new_tokens=4, temperature=0.7)
