"""The suffix drafter: a store of earlier outputs shared by a Generator's sequences (and a server's), exact drafts.

The store: matches, scopes, eviction, persistence (round trip; a damaged or foreign file refused in one line) and
threads. The drafter: scored trees and chains from this request and earlier ones. Through the engine: greedy output
identical to target-only's, alone and batched, and sampled output in the target's law with a negative control.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import char_tokenizer, loaded, tiny_llama
from test_trees import MIN_PVALUE, NEW, PROMPT, SAMPLINGS, VOCAB, _sample, one_uniform_for_every_level

import specdec.drafters.suffix as suffix
import specdec.engine.rows as rows_module
from specdec import GenerationConfig, Generator
from specdec.bench.lossless import TargetLaw, sequential_pvalue
from specdec.config import BatchConfig
from specdec.drafters import build_drafter
from specdec.drafters.base import EVERYONE, OWN, DraftSettings, HistoryScope, Sharing
from specdec.drafters.suffix import SuffixDrafter, SuffixStore
from specdec.errors import ConfigError
from specdec.verification import Uniforms


def drafter(store: SuffixStore, scope: HistoryScope = EVERYONE) -> SuffixDrafter:
    d = SuffixDrafter(store)
    d.begin(DraftSettings(scope=scope))
    return d


def test_a_store_finds_the_longest_match_and_what_followed_it_most_recently_first() -> None:
    store = SuffixStore()
    store.add([1, 2, 3, 4, 5])
    store.add([9, 3, 4, 7, 8])
    store.add([3, 4, 6])
    n, runs = store.matches([0, 3, 4], "")
    assert n == 2 and runs == [[6], [7, 8], [5]]  # "3 4" matched three times, the latest first
    assert store.matches([2, 3, 4], "") == (3, [[5]])  # a longer match wins
    assert store.matches([42], "") == (0, [])
    assert store.token_count == 13


def test_a_drafter_scores_its_tree_by_how_often_each_path_followed() -> None:
    store = SuffixStore()
    for tail in ([12, 13, 14], [12, 13, 15], [12, 20, 21], [12, 13, 14]):
        store.add([10, 11, *tail])
    tree = drafter(store).propose(torch.tensor([40, 10, 11]), k=6, branches=2)
    assert tree.tokens.tolist() == [12, 13, 14, 20, 21, 15]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 3, 1]  # parents first; siblings are distinct tokens
    # shares of the four matches, the i-th most recent weighing RECENCY**i (the latest: 12 13 14, then 12 20 21)
    weights = [suffix.RECENCY**i for i in range(4)]
    total = sum(weights)
    expected = [1.0, (weights[0] + weights[2] + weights[3]) / total, (weights[0] + weights[3]) / total]
    assert tree.scores[:3].tolist() == pytest.approx(expected)
    assert tree.scores[3] == pytest.approx(weights[1] / total)  # 20 after 12: one match, the second most recent
    assert all(a >= b for a, b in zip(tree.scores, tree.scores[1:], strict=False))  # best first
    chain = drafter(store).propose(torch.tensor([40, 10, 11]), k=6)
    # the likeliest path, without scores: the k policy sizes chains from the acceptance it measures
    assert chain.parents is None and chain.scores is None and chain.tokens.tolist() == [12, 13, 14]
    # the depth follows the match: one matched token drafts at most DEPTH_PER_MATCH, two twice as many
    store.add([7, 8, *range(50, 80)])
    assert len(drafter(store).propose(torch.tensor([40, 8]), k=16)) == round(suffix.DEPTH_PER_MATCH * 1)
    assert len(drafter(store).propose(torch.tensor([7, 8]), k=16)) == round(suffix.DEPTH_PER_MATCH * 2)


def test_a_drafter_copies_from_its_own_request_unless_the_store_matches_far_longer() -> None:
    store = SuffixStore()
    store.add([7, 8, 1, 2])
    store.add([5, 5, 7, 8, 3, 4])
    own = drafter(store)
    # "7 8" matches in its own text and in the store: its own text wins a tie
    assert own.propose(torch.tensor([7, 8, 9, 5, 6, 7, 8]), k=6, branches=2).tokens.tolist() == [9, 5, 6, 7, 8]
    # the store's "5 7 8" is longer than its own "7 8", but not OWN_WEIGHT times: its own text still wins
    assert suffix.OWN_WEIGHT * 2 >= 3
    assert own.propose(torch.tensor([7, 8, 9, 5, 6, 7, 8, 9, 5, 7, 8]), k=2).tokens.tolist() == [9, 5]
    # "5 7 8" where the request has no earlier "8": the store's
    assert drafter(store).propose(torch.tensor([6, 6, 5, 7, 8]), k=2).tokens.tolist() == [3, 4]
    # eight tokens of the store's against one of its own: the store's
    store.add(list(range(100, 120)))
    assert suffix.OWN_WEIGHT * 1 < 8
    assert drafter(store).propose(torch.tensor([113, 60, *range(104, 114)]), k=2).tokens.tolist() == [114, 115]


def test_scopes_keep_histories_apart_and_none_keeps_nothing() -> None:
    store = SuffixStore()
    alice_scope = HistoryScope.of_group("alice")
    alice = drafter(store, alice_scope)
    alice.finish(torch.tensor([0] * 20 + [5, 6, 7, 8]), prompt_length=20)  # the output, and the prompt's last tokens
    assert store.token_count == 4 + suffix.LEAD_IN
    assert drafter(store, alice_scope).propose(torch.tensor([1, 5, 6]), k=2).tokens.tolist() == [7, 8]
    assert len(drafter(store, HistoryScope.of_group("bob")).propose(torch.tensor([1, 5, 6]), k=2)) == 0
    assert len(drafter(store, EVERYONE).propose(torch.tensor([1, 5, 6]), k=2)) == 0
    private = drafter(store, OWN)
    assert len(private.propose(torch.tensor([1, 5, 6]), k=2)) == 0
    private.finish(torch.tensor([5, 6, 9, 9]), prompt_length=0)
    assert store.token_count == 4 + suffix.LEAD_IN


def test_the_oldest_sequences_leave_first_and_memory_follows() -> None:
    store = SuffixStore(max_tokens=10)
    store.add([1, 2, 3, 4])
    store.add([5, 6, 7, 8])
    full = store.nbytes
    store.add([9, 10, 11, 12])  # 12 tokens: the first sequence leaves
    assert store.token_count == 8
    assert store.matches([1, 2], "") == (0, [])
    assert store.matches([5, 6], "")[1] == [[7, 8]] and store.matches([10], "")[1] == [[11, 12]]
    for i in range(50):  # many evictions: the index and the tokens are compacted
        store.add([100 + i, 200 + i, 300 + i])
    assert store.token_count <= 10 and store.nbytes <= 2 * full
    assert store.matches([149], "")[1] == [[249, 349]]


def test_a_saved_store_loads_back_and_a_bad_file_is_refused_in_one_line(tmp_path: Path) -> None:
    store = SuffixStore()
    store.add([1, 2, 3, 4], "alice")
    store.add([5, 6, 7], "")
    path = tmp_path / "suffix.npz"
    store.save(path, model="tiny")
    loaded_store = SuffixStore.load(path, model="tiny", vocab_size=10)
    assert loaded_store.token_count == 7
    assert loaded_store.matches([2], "alice")[1] == [[3, 4]] and loaded_store.matches([2], "")[1] == []
    assert loaded_store.matches([5], "")[1] == [[6, 7]]

    refusals = {
        "another model": lambda: SuffixStore.load(path, model="other", vocab_size=10),
        "out of range": lambda: SuffixStore.load(path, model="tiny", vocab_size=5),
    }
    for match, load in refusals.items():
        with pytest.raises(ConfigError, match=match) as error:
            load()
        assert "\n" not in str(error.value)
    data = bytearray(path.read_bytes())
    npy = tmp_path / "array.npy"
    np.save(npy, np.arange(4))
    damages = {"garbage": b"not a cache at all", "truncated": bytes(data[: len(data) // 2]), "npy": npy.read_bytes()}
    for name, damage in damages.items():
        bad = tmp_path / f"{name}.npz"
        bad.write_bytes(damage)
        with pytest.raises(ConfigError, match="not a specdec suffix cache"):
            SuffixStore.load(bad, model="tiny", vocab_size=10)
    assert path.stat().st_mode & 0o077 == 0  # it holds users' answers: its owner's only
    with np.load(path) as npz:
        parts = dict(npz)
    parts["tokens"] = parts["tokens"][::-1].copy()  # the checksum no longer holds
    tampered = tmp_path / "tampered.npz"
    np.savez(tampered, **parts)
    with pytest.raises(ConfigError, match="damaged"):
        SuffixStore.load(tampered, model="tiny", vocab_size=10)


def test_a_save_never_follows_a_planted_link_nor_keeps_a_leftovers_mode(tmp_path: Path) -> None:
    """The file is written under a fresh, exclusive name: a symlink planted where a fixed temporary name would be is
    not followed (its victim stays whole), a world-readable leftover there lends the cache no mode, and the cache is
    its owner's only whatever the umask."""
    store = SuffixStore()
    store.add([1, 2, 3, 4], "alice")
    path = tmp_path / "suffix.npz"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    planted = tmp_path / "suffix.npz.tmp"
    planted.symlink_to(victim)
    store.save(path, model="tiny")
    assert victim.read_text() == "precious" and planted.is_symlink()
    assert path.stat().st_mode & 0o777 == 0o600 and SuffixStore.load(path, "tiny", 10).token_count == 4
    planted.unlink()
    planted.write_text("left over")
    planted.chmod(0o644)
    previous = os.umask(0o022)
    try:
        store.add([5, 6, 7], "")
        store.save(path, model="tiny")
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == 0o600 and SuffixStore.load(path, "tiny", 10).token_count == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["suffix.npz", "suffix.npz.tmp", "victim.txt"]  # no debris


def test_a_save_that_fails_midway_leaves_the_previous_file_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SuffixStore()
    store.add([1, 2, 3, 4])
    path = tmp_path / "suffix.npz"
    store.save(path, model="tiny")
    before = path.read_bytes()
    store.add([5, 6, 7])

    def torn(out, **arrays) -> None:
        out.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", torn)
    with pytest.raises(OSError, match="No space"):
        store.save(path, model="tiny")
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["suffix.npz"]


def _bomb(path: Path, members: dict[str, bytes], zeros: tuple[str, int] | None = None) -> None:
    """An .npz whose members are ``members``, plus (``zeros``) one .npy member of that many int32 zeros, deflated as
    it is written (a few hundred KB for tens of MB)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
        if zeros is not None:
            name, count = zeros
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(header, {"descr": "<i4", "fortran_order": False, "shape": (count,)})
            with archive.open(name, "w", force_zip64=True) as member:
                member.write(header.getvalue())
                block = bytes(2**20)
                for start in range(0, 4 * count, len(block)):
                    member.write(block[: min(len(block), 4 * count - start)])


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array(out, array, allow_pickle=False)
    return out.getvalue()


def test_a_cache_that_would_inflate_past_its_limit_is_refused_before_it_does(tmp_path: Path) -> None:
    """A small file whose member inflates far past what --suffix-max-tokens holds (a zip bomb), and one whose .npy
    header declares far more than its data (numpy's reader would allocate it first): refused in one line, fast, with
    the memory of neither."""
    meta = _npy(np.array(json.dumps({"format": suffix.FORMAT, "version": suffix.VERSION, "model": "tiny"})))
    small = {"meta.npy": meta, "lengths.npy": _npy(np.zeros(0, np.int64)), "owners.npy": _npy(np.zeros(0, np.int32))}
    bomb = tmp_path / "bomb.npz"
    _bomb(bomb, small, zeros=("tokens.npy", 20_000_000))  # 80 MB once inflated
    assert bomb.stat().st_size < 2**20
    liar = tmp_path / "liar.npz"
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<i4", "fortran_order": False, "shape": (10**9,)})
    _bomb(liar, small | {"tokens.npy": header.getvalue() + bytes(64)})
    for path, match in ((bomb, "larger than --suffix-max-tokens 1000 allows"), (liar, "not a specdec suffix cache")):
        tracemalloc.start()
        started = time.perf_counter()
        try:
            with pytest.raises(ConfigError, match=match) as error:
                SuffixStore.load(path, model="tiny", vocab_size=10, max_tokens=1000)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert time.perf_counter() - started < 2 and peak < 8 * 2**20 and "\n" not in str(error.value)
    # a cache within the limit (the default size's, at least) still loads into a smaller store, keeping its newest
    store = SuffixStore()
    for i in range(30):
        store.add([i % 10, (i + 1) % 10, (i + 2) % 10])
    store.save(tmp_path / "fine.npz", model="tiny")
    assert SuffixStore.load(tmp_path / "fine.npz", model="tiny", vocab_size=10, max_tokens=9).token_count == 9


def test_a_damaged_cache_is_moved_aside_and_the_server_starts_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A torn file (a crash while an older specdec wrote it, a bad disk) does not stop the server: it is renamed
    aside, with a warning naming both paths, and the history starts empty. A whole cache of another model is the
    user's choice of file: refused in one line, left where it is."""
    from specdec.models import open_target
    from specdec.serving.config import ServeConfig
    from specdec.serving.suffix import server_drafter

    target = open_target(loaded(tiny_llama(0, vocab=32)))
    path = tmp_path / "history.npz"
    store = SuffixStore()
    store.add([1, 2, 3, 4])
    store.save(path, model="tiny")
    torn = path.read_bytes()[:-40]
    path.write_bytes(torn)
    with caplog.at_level("WARNING", logger="specdec.serve"):
        drafter, kept = server_drafter("suffix", target, ServeConfig(suffix_cache=str(path)))
    assert kept is not None and kept.token_count == 0 and drafter.store is kept
    (aside,) = tmp_path.glob("history.npz.damaged-*")
    assert aside.read_bytes() == torn and not path.exists()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "not a specdec suffix cache" in warning and str(aside) in warning and "\n" not in warning
    path.write_bytes(b"garbage")  # a second one the same second is not renamed over the first
    server_drafter("suffix", target, ServeConfig(suffix_cache=str(path)))
    assert len(list(tmp_path.glob("history.npz.damaged-*"))) == 2
    store.save(path, model="another")
    with pytest.raises(ConfigError, match="another model"):
        server_drafter("suffix", target, ServeConfig(suffix_cache=str(path)))
    assert path.exists()
    folder = tmp_path / "a-folder"
    folder.mkdir()
    with pytest.raises(ConfigError, match="is not a file"):
        server_drafter("suffix", target, ServeConfig(suffix_cache=str(folder)))
    assert folder.is_dir()


def test_the_server_saves_its_history_while_it_runs_and_at_stop(tmp_path: Path) -> None:
    """With --suffix-save-every, the history is in its file while the server still runs (a kill then loses only what
    came after), written from a thread so requests go on; the stop writes the rest."""
    import asyncio

    import httpx

    from specdec.serving.app import create_app
    from specdec.serving.config import ServeConfig

    tokenizer = char_tokenizer()
    target = loaded(tiny_llama(0, vocab=len(tokenizer)), tokenizer=tokenizer)
    store = SuffixStore()
    path = tmp_path / "history.npz"
    config = ServeConfig(suffix_cache=str(path), suffix_save_every_s=0.05)
    app = create_app(Generator(target, SuffixDrafter(store), GenerationConfig(k=4, k_policy="fixed")), config, store)
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def run() -> int:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000"
            ) as client:
                assert (await client.post("/v1/completions", json=body, timeout=60)).status_code == 200
                deadline = time.monotonic() + 10
                while not path.exists() and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                running = SuffixStore.load(path, "tiny", len(tokenizer)).token_count
                assert (await client.post("/v1/completions", json=body | {"prompt": [9, 9, 5]})).status_code == 200
        return running

    running = asyncio.run(run())
    assert 0 < running and SuffixStore.load(path, "tiny", len(tokenizer)).token_count == store.token_count
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(ConfigError, match="suffix_save_every_s"):
        ServeConfig(suffix_save_every_s=-1)


KEEPER = """
import asyncio, sys
import numpy as np
from specdec.drafters import SuffixStore
from specdec.serving.suffix import HistoryKeeper

async def main(path: str) -> None:
    store = SuffixStore()
    store.add(np.arange(300_000) % 7)  # saves that take a while: a kill may land in the middle of one
    keeper = HistoryKeeper(store, path, "tiny", every_s=0.01)
    keeper.start()
    for i in range(10**9):
        store.add([i % 7, (i + 1) % 7, 3])
        if i == 20:
            print("fed", flush=True)
        await asyncio.sleep(0.002)

asyncio.run(main(sys.argv[1]))
"""


def test_a_killed_server_keeps_the_history_its_periodic_saves_wrote(tmp_path: Path) -> None:
    """A process saving its history every 10 ms (each save taking about as long) is SIGKILLed, likely mid-save, with
    no stop and no last save: the restart loads a whole history, nothing torn or moved aside."""
    import signal
    import subprocess
    import sys

    from specdec.models import open_target
    from specdec.serving.config import ServeConfig
    from specdec.serving.suffix import server_drafter

    target = open_target(loaded(tiny_llama(0, vocab=32)))
    path = tmp_path / "history.npz"
    child = subprocess.Popen([sys.executable, "-c", KEEPER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "fed"
        deadline = time.monotonic() + 20
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.2)  # several saves later
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    _, kept = server_drafter("suffix", target, ServeConfig(suffix_cache=str(path)))
    assert kept is not None and kept.token_count > 300_000  # the bulk and some of what came after it
    assert not list(tmp_path.glob("history.npz.damaged-*"))
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in tmp_path.iterdir())  # a killed save's temporary file too


def test_the_store_is_safe_under_threads() -> None:
    store = SuffixStore(max_tokens=5_000)
    errors: list[BaseException] = []

    def feed(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                store.add(rng.integers(0, 20, 40), scope=str(seed % 2))
                n, runs = store.matches(rng.integers(0, 20, 8).tolist(), str(seed % 2))
                assert all(-1 not in run for run in runs)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=feed, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and store.token_count <= 5_000


def test_greedy_suffix_drafts_give_the_target_only_tokens_alone_and_batched() -> None:
    """Requests that repeat earlier answers: every output is target-only's, and later requests accept drafts from the
    earlier ones (shared by the Generator's sequences, one at a time and in a batch)."""
    model = tiny_llama(4, vocab=32)
    reference = Generator(loaded(model), "none")
    prompts = [[1, 2, 3, 4], [5, 6, 7], [1, 2, 3, 4], [9, 8], [5, 6, 7]]
    expected = [reference.generate(p, max_new_tokens=24, stop_on_eos=False).token_ids for p in prompts]
    gen = Generator(loaded(model), "suffix")
    config = GenerationConfig(k=6, k_policy="fixed", branches=2, max_new_tokens=24, stop_on_eos=False)
    alone = [gen.generate(p, config) for p in prompts]
    assert [r.token_ids for r in alone] == expected
    assert alone[2].stats.draft_tokens_accepted >= 18  # the first answer, drafted from the store
    batched = gen.generate_batch(prompts, [config] * len(prompts))
    assert [r.token_ids for r in batched] == expected
    assert all(r.stats.draft_tokens_accepted >= 18 for r in batched)
    assert gen.drafter.fork().store is gen.drafter.store  # one store per Generator, shared by its sequences
    assert build_drafter("suffix", gen.target).store is not gen.drafter.store


@pytest.mark.parametrize("broken", [False, pytest.param(True, id="negative control")])
def test_sampled_suffix_chains_keep_the_target_law(monkeypatch: pytest.MonkeyPatch, broken: bool) -> None:
    """Earlier samples' outputs become later rows' chains (fixed tokens, judged against the target's own keyed draws):
    the target's law; every position drawn with its first position's uniform must fail."""
    if broken:
        original = rows_module.Chains.uniforms

        def one_for_every_position(self, row, proposal, device):
            uniforms = original(self, row, proposal, device)
            return Uniforms(uniforms.sample[:1].expand_as(uniforms.sample), uniforms.accept)

        monkeypatch.setattr(rows_module.Chains, "uniforms", one_for_every_position)
    target = tiny_llama(3, vocab=VOCAB, scale=0.15)
    # a fixed k_cap: the dynamic one caps k by this machine's measured costs, and with it how many drafts are judged
    gen = Generator(loaded(target), "suffix", batch=BatchConfig(k_cap="fixed"))
    settings = {"k": 8, "k_policy": "fixed", "branches": 1, "max_new_tokens": NEW, "stop_on_eos": False}
    configs = [GenerationConfig(**settings, sampling=SAMPLINGS["plain"], seed=s) for s in range(2000)]
    results = [r for start in range(0, 2000, 250) for r in gen.generate_batch([PROMPT] * 250, configs[start:][:250])]
    assert sum(r.stats.draft_tokens_accepted for r in results) > 1000
    samples = [tuple(r.token_ids) for r in results]
    pvalue, dof = sequential_pvalue(samples, TargetLaw(target, PROMPT, SAMPLINGS["plain"]))
    assert pvalue < MIN_PVALUE if broken else (pvalue > MIN_PVALUE and dof > 50)


@pytest.mark.parametrize("broken", [False, pytest.param(True, id="negative control")])
def test_sampled_suffix_trees_keep_the_target_law(monkeypatch: pytest.MonkeyPatch, broken: bool) -> None:
    """Earlier samples' outputs become later rows' trees of deterministic siblings: the target's law; drawing every
    level of a tree with one uniform must fail."""
    trees = []
    original = suffix._scored_tree

    def counting(*args):
        proposal = original(*args)
        trees.append(proposal.is_tree)
        return proposal

    monkeypatch.setattr(suffix, "_scored_tree", counting)
    if broken:
        one_uniform_for_every_level(monkeypatch)
    target = tiny_llama(3, vocab=VOCAB, scale=0.15)
    samples = _sample(Generator(loaded(target), "suffix"), SAMPLINGS["plain"], 2000, batched=True)
    assert sum(trees) > 1000
    pvalue, dof = sequential_pvalue(samples, TargetLaw(target, PROMPT, SAMPLINGS["plain"]))
    assert pvalue < MIN_PVALUE if broken else (pvalue > MIN_PVALUE and dof > 50)


def test_commands_refuse_what_a_learning_drafter_would_fake() -> None:
    """Settings that would measure copies of earlier answers, or share history by unchecked keys: one-line errors."""
    from typer.testing import CliRunner

    from specdec.cli.main import app
    from specdec.serving.config import ServeConfig

    with pytest.raises(ConfigError, match="no keys are set"):
        ServeConfig(suffix_scope="key")
    keyed = ServeConfig(api_keys=("k",)).scope("k")
    assert keyed.sharing is Sharing.GROUP and "k" != keyed.group and ServeConfig().scope("k") == EVERYONE
    assert ServeConfig(suffix_scope="request").scope("k") == OWN
    result = CliRunner().invoke(app, ["serve", "--draft", "prompt-lookup", "--suffix-max-tokens", "10"])
    assert result.exit_code == 2 and "add --draft suffix" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["serve", "--draft", "suffix", "--suffix-save-every", "60"])
    assert result.exit_code == 2 and "add --suffix-cache FILE" in result.output


def test_bench_batch_gives_a_learning_drafter_afresh_to_every_batch_and_method(
    tiny_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Suffix drafting in bench-batch: each k_cap and batch size drafts from a new history (none copies the answers
    another method gave to the same prompts), and every method's greedy answers are target-only's."""
    from specdec.bench.batch import METHODS, BatchBenchConfig, markdown, run_batch_benchmark

    built: list[SuffixStore] = []
    original = SuffixStore.__init__

    def counting(self: SuffixStore, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(SuffixStore, "__init__", counting)
    prompts = tmp_path / "prompts.jsonl"
    lines = [f'{{"id": "p{i}", "category": "c{i % 2}", "prompt": "abcab{i}cabc"}}' for i in range(4)]
    prompts.write_text("\n".join(lines) + "\n")
    config = BatchBenchConfig(
        target=str(tiny_folder), draft="suffix", batch_sizes=(2, 3), max_new_tokens=8, k=3, prompts=str(prompts)
    )
    results = run_batch_benchmark(config)
    for figures in results["batches"].values():
        assert all(entry["identical_share"] == 1.0 for entry in figures.values())
        assert tuple(figures) == METHODS and figures["fixed k_cap"]["mean_k_cap"] is None  # the fixed one caps nothing
    assert "| mean k_cap |" in markdown(results)
    # the first Generator's, the warm-up's three, then three a batch size (fixed, dynamic, one at a time)
    assert len(built) == 1 + 3 + 3 * 2
