"""The native runtime's paged KV cache: each element type read back as its rounded values, growth that copies
nothing, sliding-window layers that hold their window only, trees whose accepted path crosses a page edge."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gemma3

from specdec.models.native import NativeBackend, NativeModel, kernel_build, ops
from specdec.models.native.paged_cache import PAGE, PagedCache

pytestmark = pytest.mark.skipif(kernel_build.compiled() is None, reason="the native backend needs AVX2 and g++")
TYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal float64 attention of q [n, heads, dim] after ``start`` cached positions over keys, values [m, kv, dim]."""
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    k, v = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k) * scale
    hidden = torch.arange(keys.shape[0])[None] > (start + torch.arange(n))[:, None]
    weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hnm,mhd->nhd", weights, v)


@pytest.mark.parametrize("dim", [32, 256])
@pytest.mark.parametrize("dtype", list(TYPES))
def test_each_cache_type_holds_its_rounded_values_and_a_positions_bits_do_not_depend_on_the_others(
    dtype: str, dim: int
) -> None:
    """Across a page edge: 9 positions at once give the bits of the same positions one at a time, and equal float64
    attention over the keys and values rounded to the cache's type (to nearest, as torch rounds them). Four heads share
    a KV head: 9 positions read each key once for four heads, one position alone does not (and 256 lanes take the
    kernel's four-lanes-at-a-time path)."""
    generator = torch.Generator().manual_seed(0)
    start, n, heads, kv_heads = PAGE - 4, 9, 8, 2
    q = torch.randn(start + n, heads, dim, generator=generator)
    k, v = (
        torch.randn(start + n, kv_heads, dim, generator=generator),
        torch.randn(start + n, kv_heads, dim, generator=generator),
    )
    together, alone = PagedCache((0,), kv_heads, dim, dtype), PagedCache((0,), kv_heads, dim, dtype)
    for cache in (together, alone):
        cache.reserve(start)
        ops.attention(q[:start], k[:start], v[:start], cache, 0, 0, 0, 0.2)
        cache.length = start
    together.reserve(start + n)
    at_once = ops.attention(q[start:], k[start:], v[start:], together, 0, start, 0, 0.2)
    singles = []
    for i in range(start, start + n):
        alone.reserve(i + 1)
        singles.append(ops.attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], alone, 0, i, 0, 0.2))
        alone.length = i + 1
    assert torch.equal(at_once, torch.cat(singles))
    rounded = TYPES[dtype]
    expected = reference(q[start:], k.to(rounded).float(), v.to(rounded).float(), start, 0.2)
    assert torch.allclose(at_once.double(), expected, atol=2e-5), float((at_once.double() - expected).abs().max())
    if dtype != "float32":  # the rounding is real: float32 keys give other numbers
        assert not torch.allclose(at_once.double(), reference(q[start:], k, v, start, 0.2), atol=1e-6)


def test_growth_adds_pages_and_copies_nothing() -> None:
    cache = PagedCache((0, 0), kv_heads=1, head_dim=16, dtype="bfloat16")
    cache.reserve(10)
    first = cache.pages[0][0]
    cache.length = 10
    cache.reserve(3 * PAGE + 1)
    assert cache.pages[0][0] is first and len(cache.pages[1]) == 4
    assert cache.nbytes == 2 * 4 * (2 * PAGE * 16 * 2)  # 2 layers, 4 pages of keys and values in bfloat16
    with pytest.raises(Exception, match="unknown KV cache type 'int3'"):
        PagedCache((0,), 1, 16, "int3")


@pytest.mark.parametrize("window", [6, PAGE + 44])
def test_sliding_window_layers_hold_their_window_only(window: int) -> None:
    """Gemma-3 (three layers with a window, one without) decoded to 3 pages and more in chunks: the windowed layers
    hold at most window // PAGE + 3 pages, the full layer all of them, and every logit equals the whole text's at once.
    A step back within a page works; further back than the window layers hold is refused in one line."""
    gemma = tiny_gemma3(3, vocab=64, sliding_window=window, hidden=64, head_dim=16, context=4096)
    model = NativeModel.from_module(gemma)
    length = window + 3 * PAGE + 50
    ids = torch.randint(3, 64, (1, length), generator=torch.Generator().manual_seed(1))
    whole = NativeBackend(model).forward(ids, last=length)[0]
    backend = NativeBackend(model)
    chunks = [backend.forward(ids[:, i : i + 7], last=len(ids[0, i : i + 7]))[0] for i in range(0, length, 7)]
    assert torch.equal(torch.cat(chunks), whole)
    held = [sum(page is not None for page in pages) for pages in backend.cache.pages]
    assert max(held[:3]) <= window // PAGE + 3 and held[3] == -(-length // PAGE), held
    backend.truncate(length - 20)
    again = backend.forward(ids[:, length - 20 :], last=20)[0]
    assert torch.equal(again, whole[length - 20 :])
    with pytest.raises(ValueError, match="sliding-window cache no longer holds position"):
        backend.truncate(PAGE // 2)
    with pytest.raises(ValueError, match="cannot end a cache"):
        backend.truncate(2, branch=[1, 3, 5])  # a path longer than what it would end
    backend.reset()  # from the start again: nothing is read that was released
    assert torch.equal(backend.forward(ids[:, :40], last=40)[0], whole[:40])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_trees_accepted_path_moves_across_a_page_edge(dtype: str) -> None:
    """Either cache type: a tree verified from PAGE - 3 cached positions, its accepted path (nodes 1, 3, 5) kept: the
    next step's logits equal those after decoding the path as a chain."""
    model = NativeModel.from_module(tiny_gemma3(4, vocab=64, hidden=64, head_dim=16, context=4096))
    prefix = torch.randint(3, 64, (1, PAGE - 3), generator=torch.Generator().manual_seed(2))
    nodes = torch.tensor([[10, 11, 12, 13, 14, 15]])
    parents = torch.tensor([-1, -1, 1, 1, 3, 3])  # 1 -> 3 -> 5 is a path of depth 3
    path, after = torch.tensor([[11, 13, 15]]), torch.tensor([[20, 21]])
    tree, chain = NativeBackend(model, dtype), NativeBackend(model, dtype)
    for backend in (tree, chain):
        backend.forward(prefix, last=1)
    tree.forward(nodes, last=6, tree=parents)
    tree.truncate(PAGE, branch=[PAGE - 3 + 1, PAGE - 3 + 3, PAGE - 3 + 5])
    chain.forward(path, last=3)
    assert torch.equal(tree.forward(after, last=2), chain.forward(after, last=2))


def test_the_cache_follows_the_weights_format_unless_asked() -> None:
    model = tiny_gemma3(3, vocab=64, hidden=64, head_dim=16)
    assert NativeBackend(NativeModel.from_module(model, "int8")).cache.dtype == "float32"
    int4 = NativeModel.from_module(model, "int4")
    assert NativeBackend(int4).cache.dtype == "bfloat16" and NativeBackend(int4, "float16").cache.dtype == "float16"
    assert "kv=bfloat16" in NativeBackend(int4).identity  # cost records and profiles tell the caches apart
