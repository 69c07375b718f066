"""Precision plans: parsing, conversion per component, greedy identity within a plan, perplexity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import char_tokenizer, loaded, tiny_gemma3, tiny_llama
from typer.testing import CliRunner

from specdec import Generator
from specdec.bench.perplexity import perplexity
from specdec.cli.main import app
from specdec.config import PRESETS, PrecisionPlan, RuntimeConfig
from specdec.drafters.layer_skip import shallow_view
from specdec.errors import ConfigError
from specdec.models import TransformersBackend
from specdec.models.precision import (
    QUANTIZED,
    QuantizedLinear,
    RowStableLinear,
    apply_plan,
    convert_draft,
    padded_eager_attention,
    precision_of,
)

PROMPTS = ["the cat sat", "a dog and a log", "xyz 123", "Hello, world!"]


def test_plans_parse_from_presets_and_parts() -> None:
    assert PrecisionPlan.parse("fp32") == PrecisionPlan()
    assert PrecisionPlan.parse("fp8-draft") == PrecisionPlan(
        attention="float16", ffn="int8", head="float16", draft="float8", verify="float16"
    )
    with pytest.warns(FutureWarning, match="now called 'fp8-draft'"):
        assert PrecisionPlan.parse("seed") == PrecisionPlan.parse("fp8-draft")  # the old name, for one release
    assert PrecisionPlan.parse("ffn=int8, head=bfloat16") == PrecisionPlan(ffn="int8", head="bfloat16")
    with pytest.raises(ConfigError, match="int4: use one of"):
        PrecisionPlan.parse("ffn=int4")
    with pytest.raises(ConfigError, match="preset"):
        PrecisionPlan.parse("mlp=int8")
    with pytest.raises(ConfigError, match="verification logits"):
        PrecisionPlan.parse("verify=int8")
    with pytest.raises(ConfigError, match="GGUF"):
        RuntimeConfig(backend="llama.cpp", precision=PRESETS["bf16"])


def test_int8_and_float8_linears_stay_close_to_float() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True)
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        expected = linear(x)
    for fmt, tolerance in (("int8", 0.03), ("int8a8", 0.03), ("float8", 0.08)):
        quantized = QuantizedLinear(linear, fmt)
        # int8a8: packed for the VNNI kernel
        stored = quantized.packed.packed if fmt == "int8a8" else quantized.weight_q
        assert stored.dtype == (torch.float8_e4m3fn if fmt == "float8" else torch.int8)
        got = quantized(x).float()
        assert got.shape == expected.shape
        assert float((got - expected).norm() / expected.norm()) < tolerance, fmt


@pytest.mark.parametrize("preset", list(PRESETS))
def test_each_preset_converts_every_component_and_stays_close(preset: str) -> None:
    reference = tiny_gemma3(0)
    model = tiny_gemma3(0)
    plan = PRESETS[preset]
    apply_plan(model, plan)
    ids = torch.randint(3, 96, (1, 20))
    with torch.inference_mode():
        base, logits = reference(ids).logits, model(ids).logits
    assert logits.dtype == getattr(torch, plan.verify)  # the verifier reads the plan's verification format
    got = logits.float()
    assert float((got - base).abs().max()) < 0.1 * float(base.abs().max())
    layer = model.model.layers[0]
    for module, fmt in (
        (layer.self_attn, plan.attention),
        (layer.mlp, plan.ffn),
        (model.get_output_embeddings(), plan.head),
    ):
        quantized = [m for m in module.modules() if isinstance(m, QuantizedLinear)]
        if fmt in QUANTIZED:
            assert quantized and all(m.format == fmt for m in quantized)
        else:
            assert not quantized and all(p.dtype == getattr(torch, fmt) for p in module.parameters())
    assert model.get_input_embeddings().weight.shape == reference.get_input_embeddings().weight.shape


@pytest.mark.parametrize(("outputs", "width"), [(300, 128), (77, 256), (40, 96)])
def test_int8a8_products_are_exact_and_row_independent(
    monkeypatch: pytest.MonkeyPatch, outputs: int, width: int
) -> None:
    """The VNNI kernel (where this CPU has it) and the float64 path give the same bits; a row's result does not depend
    on the rows computed with it (what speculative greedy identity needs); both equal the integer products per group of
    inputs, scaled in the documented order. Widths of one group, two groups and a 32-wide group; outputs not a
    multiple of the 16-output block."""
    from specdec.models.native import formats, kernel_build

    torch.manual_seed(0)
    weight, x = torch.randn(outputs, width), torch.randn(21, width) * 3  # 21 rows: a tile of 12 and one of 9
    x[3, 5] = 40.0  # an outlier spoils the scale of its own group only
    packed = formats.PackedInt8(weight)
    got = formats.linear(x, packed)
    w8, w_scale = formats.quantize_rows(weight)
    q, q_scale = formats.quantize_rows(x, packed.group)
    expected = torch.zeros(21, outputs)
    for g in range(width // packed.group):
        cols = slice(g * packed.group, (g + 1) * packed.group)
        expected = expected + (q[:, cols].long() @ w8[:, cols].long().T).float() * q_scale[:, g : g + 1]
    assert torch.equal(got, expected * w_scale)
    assert torch.equal(got, torch.cat([formats.linear(x[i : i + 1], packed) for i in range(21)]))
    monkeypatch.setattr(kernel_build, "compiled", lambda: None)  # the path of a CPU without VNNI
    assert torch.equal(formats.linear(x, packed), got)


def test_cpu_vnni_greedy_identity_through_the_kernel() -> None:
    """A model 64 wide: its int8a8 head runs the VNNI kernel (if this CPU has it) in decode and verification alike."""
    tokenizer = char_tokenizer()
    runtime = RuntimeConfig(precision=PRESETS["cpu-vnni"])
    target = Generator(
        loaded(tiny_llama(2, vocab=len(tokenizer), hidden=64), tokenizer=tokenizer), "none", runtime=runtime
    )
    drafted = Generator(target.target, "prompt-lookup", runtime=runtime)
    for prompt in PROMPTS:
        expected = target.generate(prompt, max_new_tokens=24, stop_on_eos=False).token_ids
        assert (
            drafted.generate(prompt, max_new_tokens=24, k=4, k_policy="fixed", stop_on_eos=False).token_ids == expected
        ), prompt


def test_a_rows_result_does_not_depend_on_the_rows_and_keys_beside_it() -> None:
    """What greedy identity needs of a plan's 16-bit layers: a position computes alike alone (decode), among a few
    (verification) or among many (a prompt, a batch), whatever the keys after it. On CPUs with AMX, bfloat16 products
    of about 32 rows and more, and attention over a different number or layout of keys, round otherwise unless split
    (gemma-3-270m's widths)."""
    gen = torch.Generator().manual_seed(0)
    linear = RowStableLinear(640, 2048, bias=False, dtype=torch.bfloat16)
    x = torch.randn(48, 640, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([linear(x[i : i + 1]) for i in range(48)])
        for rows in (2, 17, 33, 48):
            assert torch.equal(linear(x[:rows]), alone[:rows]), rows
        queries, keys = 20, 150  # the context fills two key blocks before the queries
        q = torch.randn(1, 4, queries, 256, generator=gen).to(torch.bfloat16)
        k, v = (torch.randn(1, 1, keys, 256, generator=gen).to(torch.bfloat16) for _ in range(2))
        # causal: query i sees keys 0..130 + i
        visible = torch.arange(keys)[None, :] <= torch.arange(keys - queries, keys)[:, None]
        mask = torch.zeros(1, 1, queries, keys, dtype=torch.bfloat16).masked_fill(
            ~visible, torch.finfo(torch.bfloat16).min
        )
        module = torch.nn.Module().eval()
        together = padded_eager_attention(module, q, k, v, mask)[0]
        for i in range(queries):
            seen = keys - queries + i + 1  # decode: the query alone with exactly the keys it sees
            single = padded_eager_attention(
                module, q[:, :, i : i + 1], k[:, :, :seen], v[:, :, :seen], mask[:, :, i : i + 1, :seen]
            )[0]
            assert torch.equal(single[:, 0], together[:, i]), i
        # Trees of drafts in a batch of two: node i sees the context and the nodes of its path (every second or third
        # one up to itself).
        context, order = keys - queries, torch.arange(queries)
        trees = torch.stack([visible, visible]).unsqueeze(1)
        for row, every in enumerate((2, 3)):
            trees[row, 0, :, context:] &= (order[None, :] <= order[:, None]) & (
                (order[None, :] % every == 0) | (order[None, :] == order[:, None])
            )
        q2, k2, v2 = torch.cat([q, q.flip(2)]), torch.cat([k, k.flip(2)]), torch.cat([v, v.flip(2)])
        mask = torch.zeros(trees.shape, dtype=torch.bfloat16).masked_fill(~trees, torch.finfo(torch.bfloat16).min)
        together, weights = padded_eager_attention(module, q2, k2, v2, mask)
        for row in range(2):
            for i in range(queries):
                path = trees[row, 0, i].nonzero().squeeze(1)  # decode: the node's path laid out as a sequence
                r = slice(row, row + 1)
                single, alone = padded_eager_attention(
                    module, q2[r, :, i : i + 1], k2[r, :, path], v2[r, :, path], mask[r, :, i : i + 1, path]
                )
                assert torch.equal(single[0, 0], together[row, i]), ("tree", row, i)
                assert (
                    torch.equal(alone[0, :, 0], weights[row, :, i, path])
                    and not weights[row, :, i, ~trees[row, 0, i]].any()
                )
        # A lone tree node: of two roots, the second sees the context and itself.
        roots = visible[-2:].clone()
        roots[1, -2] = False
        mask = torch.zeros(1, 1, 2, keys, dtype=torch.bfloat16).masked_fill(~roots, torch.finfo(torch.bfloat16).min)
        together = padded_eager_attention(module, q[:, :, -2:], k, v, mask)[0]
        path = roots[1].nonzero().squeeze(1)
        single = padded_eager_attention(module, q[:, :, -1:], k[:, :, path], v[:, :, path], mask[:, :, 1:, path])[0]
        assert torch.equal(single[:, 0], together[:, 1])


def test_a_plan_applies_once_and_refuses_a_second_plan() -> None:
    model = tiny_llama(0)
    assert precision_of(model) is None
    apply_plan(model, PRESETS["bf16"])
    apply_plan(model, PRESETS["bf16"])  # the same plan again: nothing to do
    assert precision_of(model) == PRESETS["bf16"].describe()
    with pytest.raises(ConfigError, match="load it again"):
        apply_plan(model, PRESETS["cpu"])
    # the plan keys measured costs, a layerskip view's too (its modules are the target's)
    for backend in (TransformersBackend(model), TransformersBackend(shallow_view(model, 1))):
        assert PRESETS["bf16"].describe() in backend.identity


@pytest.mark.parametrize("preset", ["bf16", "fp8-draft", "cpu", "cpu-vnni"])
def test_speculative_greedy_equals_target_only_greedy_of_the_same_plan(preset: str) -> None:
    tokenizer = char_tokenizer()
    runtime = RuntimeConfig(precision=PRESETS[preset])
    target = Generator(loaded(tiny_gemma3(1, vocab=len(tokenizer)), tokenizer=tokenizer), "none", runtime=runtime)
    # Trees (prompt lookup's matches, 4 branches) too: their nodes see their paths only, past the sliding window (6).
    for drafter, branches in (("prompt-lookup", 1), ("prompt-lookup", 4), ("layerskip:2", 1)):
        drafted = Generator(target.target, drafter, runtime=runtime)
        for prompt in PROMPTS:
            expected = target.generate(prompt, max_new_tokens=24, stop_on_eos=False).token_ids
            got = drafted.generate(
                prompt, max_new_tokens=24, k=4, k_policy="fixed", branches=branches, stop_on_eos=False
            )
            assert got.token_ids == expected, (preset, drafter, branches, prompt)


def test_a_draft_model_runs_in_the_plans_draft_format() -> None:
    target, draft = tiny_llama(0), tiny_llama(1)
    convert_draft(draft, "float8")
    assert precision_of(draft) == "float8" and "|float8|" in TransformersBackend(draft).identity
    assert all(isinstance(layer.mlp.down_proj, QuantizedLinear) for layer in draft.model.layers)
    assert draft.get_input_embeddings().weight.dtype == torch.float32  # the embedding (maybe shared) is left alone
    generator = Generator(loaded(target), "none")
    from specdec.drafters import ModelDrafter

    drafted = Generator(generator.target, ModelDrafter(TransformersBackend(draft)))
    ids = [5, 9, 11, 20]
    expected = generator.generate(ids, max_new_tokens=16, stop_on_eos=False).token_ids
    assert drafted.generate(ids, max_new_tokens=16, k=3, k_policy="fixed", stop_on_eos=False).token_ids == expected


@pytest.fixture
def tiny_model_folder(tmp_path: Path) -> Path:
    tokenizer = char_tokenizer()
    folder = tmp_path / "tiny-gemma"
    tiny_gemma3(2, vocab=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_perplexity_against_float32_on_the_same_tokens(tiny_model_folder: Path, tmp_path: Path) -> None:
    data = tmp_path / "text.txt"
    data.write_text("the cat sat on the mat. " * 40)
    same = perplexity(
        str(tiny_model_folder), RuntimeConfig(precision=PRESETS["fp32"]), str(data), max_tokens=600, window=128
    )
    assert same.tokens == 600 and same.delta == 0.0 and same.perplexity > 1
    low = perplexity(
        str(tiny_model_folder), RuntimeConfig(precision=PRESETS["cpu"]), str(data), max_tokens=600, window=128
    )
    assert low.float32_perplexity == same.float32_perplexity
    assert low.perplexity != same.perplexity and abs(low.delta) < 0.05 * same.perplexity
    result = CliRunner().invoke(
        app,
        [
            "ppl",
            "--target",
            str(tiny_model_folder),
            "--data",
            str(data),
            "--precision",
            "cpu",
            "--max-tokens",
            "300",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["plan"] == PRESETS["cpu"].describe() and report["tokens"] == 300
    missing = CliRunner().invoke(app, ["ppl", "--target", str(tiny_model_folder), "--data", str(tmp_path / "nope.txt")])
    assert missing.exit_code == 2 and "not a file" in missing.output
    bad = CliRunner().invoke(app, ["generate", "hi", "--target", str(tiny_model_folder), "--precision", "ffn=int3"])
    assert bad.exit_code == 2 and "int3" in bad.output
