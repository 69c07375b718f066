"""Shared fixtures: tiny random-weight models (fast, any shape) and the real bundled Gemma target."""

from __future__ import annotations

import string
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from specdec.models import LoadedModel, ModelSource
from specdec.scheduling import StepOutcome

torch.set_num_threads(2)

CHARS = string.ascii_letters + string.digits + " .,;:!?'\"()-\n"
SPECIALS = ["<unk>", "<bos>", "<eos>"]


def tiny_llama(
    seed: int, vocab: int = 96, layers: int = 2, scale: float = 0.3, context: int = 256, hidden: int = 32
) -> LlamaForCausalLM:
    """A random Llama whose logits are peaked enough that greedy ties are negligible."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        initializer_range=scale,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def tiny_gemma3(
    seed: int, vocab: int = 96, sliding_window: int = 6, hidden: int = 32, head_dim: int = 8, context: int = 256
) -> Gemma3ForCausalLM:
    """A random Gemma-3 with a tiny sliding window, so cache rollback crosses the window edge."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=context,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,  # tied random embeddings make the model copy its last token forever
    )
    return Gemma3ForCausalLM(config).eval()


def perturbed(model, noise: float, seed: int = 0):
    """A copy of ``model`` with Gaussian noise on every weight: a draft that agrees only sometimes."""
    import copy

    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn_like(param) * noise * param.std().clamp(min=1e-3))
    return draft


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>")


def loaded(model, name: str = "tiny", tokenizer=None) -> LoadedModel:
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, source=ModelSource(name, "folder", name))


def assert_lookup_matches_greedy(
    target, prompts: list[str], max_new_tokens: int, k: int = 4, k_policy: str = "fixed"
) -> int:
    """Prompt lookup must reproduce target-only greedy output on every prompt; returns draft tokens accepted."""
    from specdec import Generator

    baseline, lookup = Generator(target, "none"), Generator(target, "prompt-lookup")
    accepted = 0
    for prompt in prompts:
        expected = baseline.generate(prompt, max_new_tokens=max_new_tokens)
        got = lookup.generate(prompt, max_new_tokens=max_new_tokens, k=k, k_policy=k_policy)
        assert got.token_ids == expected.token_ids, prompt
        assert got.text == expected.text
        assert got.stats.target_forwards <= expected.stats.target_forwards
        accepted += got.stats.draft_tokens_accepted
    return accepted


@pytest.fixture
def tiny_folder(tmp_path: Path) -> Path:
    """A saved tiny Llama with a character tokenizer: a real local model folder."""
    tokenizer = char_tokenizer()
    model = tiny_llama(0, vocab=len(tokenizer))
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def gemma() -> LoadedModel:
    from specdec.models import load_model

    return load_model("gemma-3-270m")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """A one-node Ray cluster on loopback (host:port), started for the tests that ask for it and stopped after them."""
    pytest.importorskip("ray")
    import os
    import shutil
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # A loopback-only test cluster: token authentication off for it and every process that joins it, so
    # that a token some other local cluster left in ~/.ray does not make the cluster and its clients disagree.
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray = shutil.which("ray")
    command = [ray, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1"]
    command += ["--num-cpus=6", "--include-dashboard=false", "--disable-usage-stats"]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    yield f"127.0.0.1:{port}"
    subprocess.run([ray, "stop", "--force"], capture_output=True, timeout=120)


@pytest.fixture
def threads(request: pytest.FixtureRequest):
    """torch's thread count for one test (more than this machine's cores is fine: the bits are what is checked)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def step_outcome(
    depth: int,
    accepted: int,
    *,
    nodes: int | None = None,
    draft_s: float = 0.0,
    draft_steps: int | None = None,
    branched: bool = False,
    verify_s: float | None = None,
    context_length: int = 10,
    logits: torch.Tensor | None = None,
) -> StepOutcome:
    """A step for a k policy to observe: k = ``depth`` chosen and drafted (``nodes`` verified, by default ``depth``;
    ``draft_steps`` forwards of a drafting model, by default one per level); ``verify_s`` None: the step also read the
    prompt, so its target time is not its drafts'."""
    return StepOutcome(
        chosen=depth,
        asked=depth,
        depth=depth,
        nodes=depth if nodes is None else nodes,
        accepted=accepted,
        branched=branched,
        draft_s=draft_s,
        draft_steps=depth if draft_steps is None else draft_steps,
        target_s=0.0 if verify_s is None else verify_s,
        anchored=False,
        read_prompt=verify_s is None,
        context_length=context_length,
        logits=torch.zeros(accepted + 1, 4) if logits is None else logits,
        new_tokens=torch.zeros(accepted + 1, dtype=torch.long),
    )
