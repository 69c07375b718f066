"""What memory admission counts as free: a container's cgroup limit (fake cgroup folders), a GPU's free memory, and
the KV cache a batched transformers backend says its rows take."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest
import torch
from conftest import char_tokenizer, loaded, tiny_llama

from specdec import GenerationConfig, Generator
from specdec import memory as memory_module
from specdec.memory import available_bytes, cgroup_available
from specdec.models.batched import BatchedTransformersBackend

GIB = 2**30
HOST = namedtuple("Memory", "available")


def _cgroups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, membership: str, files: dict[str, str]) -> None:
    """A cgroup file system under tmp_path (``files``: path under its root -> content) and a /proc/self/cgroup saying
    ``membership``, in place of the machine's."""
    root = tmp_path / "cgroup"
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    root.mkdir(exist_ok=True)
    (tmp_path / "proc-self-cgroup").write_text(membership)
    monkeypatch.setattr(memory_module, "CGROUP_ROOT", root)
    monkeypatch.setattr(memory_module, "PROC_CGROUP", tmp_path / "proc-self-cgroup")


def test_cgroup_v2_limits_up_the_tree_cap_the_host_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """v2: the tightest of the process's cgroup and those above it (memory.max less memory.current, inactive file
    pages counting as free), capped by the host's available memory."""
    _cgroups(
        tmp_path,
        monkeypatch,
        "0::/kubepods/pod1/container\n",
        {
            "kubepods/memory.max": "max\n",
            "kubepods/memory.current": f"{40 * GIB}\n",
            "kubepods/pod1/memory.max": f"{8 * GIB}\n",
            "kubepods/pod1/memory.current": f"{7 * GIB}\n",
            "kubepods/pod1/memory.stat": f"anon {6 * GIB}\ninactive_file {GIB // 2}\nactive_file 4096\n",
            "kubepods/pod1/container/memory.max": "max\n",
            "kubepods/pod1/container/memory.current": f"{7 * GIB}\n",
        },
    )
    assert cgroup_available() == GIB + GIB // 2
    monkeypatch.setattr(memory_module.psutil, "virtual_memory", lambda: HOST(64 * GIB))
    assert available_bytes(torch.device("cpu")) == GIB + GIB // 2  # the host's 64 GiB would over-admit
    monkeypatch.setattr(memory_module.psutil, "virtual_memory", lambda: HOST(GIB))
    assert available_bytes(torch.device("cpu")) == GIB


def test_a_container_reads_its_own_cgroup_at_the_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a cgroup namespace the process's path is "/", or a host path the container's mount does not have: its limit
    is the mount's root's."""
    files = {"memory.max": f"{2 * GIB}\n", "memory.current": f"{GIB + 100}\n"}
    for membership in ("0::/\n", "0::/system.slice/docker-abc.scope\n"):
        _cgroups(tmp_path, monkeypatch, membership, files)
        assert cgroup_available() == GIB - 100


def test_cgroup_v1_and_no_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    membership = "5:devices:/\n4:memory:/process_api/abc\n3:cpu,cpuacct:/\n0::/\n"
    _cgroups(
        tmp_path,
        monkeypatch,
        membership,
        {
            "memory/process_api/abc/memory.limit_in_bytes": f"{4 * GIB}\n",
            "memory/process_api/abc/memory.usage_in_bytes": f"{3 * GIB}\n",
            "memory/process_api/abc/memory.stat": "cache 0\ntotal_inactive_file 1024\n",
        },
    )
    assert cgroup_available() == GIB + 1024
    _cgroups(tmp_path, monkeypatch, "0::/user.slice\n", {"user.slice/memory.max": "max\n"})  # no limit anywhere
    assert cgroup_available() is None
    monkeypatch.setattr(memory_module, "PROC_CGROUP", tmp_path / "missing")  # no cgroups at all (not Linux)
    assert cgroup_available() is None
    monkeypatch.setattr(memory_module.psutil, "virtual_memory", lambda: HOST(3 * GIB))
    assert available_bytes(torch.device("cpu")) == 3 * GIB


def test_on_cuda_the_free_figure_is_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device's free memory, plus what PyTorch's allocator holds without using it; the host's is not read."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 6 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 5 * GIB)
    monkeypatch.setattr(memory_module, "cgroup_available", lambda: pytest.fail("a GPU's memory is no cgroup's"))
    assert available_bytes(torch.device("cuda", 0)) == 11 * GIB


def test_batched_transformers_rows_say_what_their_caches_take() -> None:
    """Layers x key/value heads x head size x 2 x bytes per slot; every row as many slots as the longest, grown by half
    at a time: at every step the caches hold at most what kv_bytes_for_rows says for the rows' lengths."""
    model = tiny_llama(0, context=1024)  # 2 layers, 2 key/value heads of 32 / 4 = 8 dimensions, float32
    rows = BatchedTransformersBackend(model)
    slot = 2 * 2 * 8 * 2 * 4
    assert rows.kv_bytes_for(100) == 128 * 3 // 2 * slot  # 100 slots rounded to 128, and half again
    rows.add_rows(3)
    generator = torch.Generator().manual_seed(0)
    for sizes in [(30, 5, 1), (1, 40, 2), (70, 1, 1), (9, 9, 9), (200, 3, 3), (1, 1, 1)]:
        feeds = [torch.randint(3, 96, (n,), generator=generator) for n in sizes]
        rows.forward([0, 1, 2], feeds, last=1)
        assert rows.kv_bytes() <= rows.kv_bytes_for_rows(rows.cached_lengths)
    assert rows.kv_bytes() >= 3 * max(rows.cached_lengths) * slot  # the longest's slots in every row
    assert rows.kv_bytes_for_rows([1, 1, 1]) == rows.kv_bytes()  # the buffer never shrinks
    assert rows.kv_bytes_for(10) == 96 * slot  # once made, the buffers' own size per slot


def test_the_server_admits_by_memory_on_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched transformers backend says what a request's cache takes, so the server refuses a request whose cache
    could never fit in the memory available (400) and one that fits alone but not beside those already taken (503)."""
    from test_serve_faults import _ask

    from specdec.serving import batcher as batcher_module
    from specdec.serving.app import create_app
    from specdec.serving.batcher import Job, MemoryFullError

    tokenizer = char_tokenizer()
    target = loaded(tiny_llama(0, vocab=len(tokenizer)), tokenizer=tokenizer)
    generator = Generator(target, "prompt-lookup", GenerationConfig(k=4, k_policy="fixed"))
    app = create_app(generator)
    batcher = app.state.batcher
    rows = batcher.decoder.backend
    assert isinstance(rows, BatchedTransformersBackend)
    one = rows.kv_bytes_for_rows([7 + 150])  # "abc abc" and 150 tokens
    monkeypatch.setattr(batcher_module, "available_bytes", lambda device: int(one * 1.5))

    batcher.waiting.append(Job(generator.completion("abc abc", max_new_tokens=150), None))  # type: ignore[arg-type]
    with pytest.raises(MemoryFullError, match="would need") as refused:
        batcher._check_memory(Job(generator.completion("abc abc", max_new_tokens=150), None))  # type: ignore[arg-type]
    assert not refused.value.alone
    batcher.waiting.clear()

    monkeypatch.setattr(batcher_module, "available_bytes", lambda device: one // 2)
    batcher.start()
    try:
        alone = _ask(app, "POST", "/v1/completions", {"prompt": "abc abc", "max_tokens": 150, "temperature": 0})
        error = alone.json()["error"]
        assert alone.status_code == 400 and (error["code"], error["param"]) == ("insufficient_memory", "max_tokens")
        answered = _ask(app, "POST", "/v1/completions", {"prompt": "abc abc", "max_tokens": 4, "temperature": 0})
        assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] == 4
    finally:
        batcher.stop(5)
