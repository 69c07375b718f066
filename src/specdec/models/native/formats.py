"""specdec's packed weight formats and their product with activations, ``linear(x, packed)``: ``x @ W.T`` with
``PackedInt8`` (int8, one scale per output) or ``PackedInt4`` (4 bits, a step and a minimum per 32 inputs) weights and
int8 activations (one scale per group of a position's inputs, so an outlier spoils only its group). Integer products
are exact; the float32 steps after them run in a fixed order, so a position's result does not depend on how many
positions are multiplied together. The weights are packed in blocks of 16 outputs, each read from memory once per
call, whatever the number of positions.
"""

from __future__ import annotations

import abc
import hashlib
import json
import time

import torch

from specdec.atomic import PUBLIC, atomic_write_bytes
from specdec.errors import ConfigError
from specdec.models.native import kernel_build
from specdec.models.registry import cache_root

GROUP = 128  # activation inputs per scale (a narrower layer uses the widest of 64 and 32 that divides it)
BLOCK = 16  # outputs per packed block: one AVX-512 vector of int32 sums
FALLBACK_ROWS = 8192  # weight rows per float64 product on the exact path without the kernel


class Packed(torch.nn.Module, abc.ABC):
    """A linear layer's weights in one of the native formats, for ``linear``."""

    format: str  # "int8" or "int4"
    in_features: int
    out_features: int
    packed: torch.Tensor  # the weights' integers, block-major (every format's main buffer)

    @abc.abstractmethod
    def product(self, kernel, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ W.T`` [n, outputs padded to a block] by the compiled kernels."""

    def argmax(self, kernel, rows: torch.Tensor) -> torch.Tensor:
        """The first index of each row's largest output of ``product`` [n] (a format whose kernel finds it without
        writing the outputs overrides this)."""
        return self.product(kernel, rows)[:, : self.out_features].max(dim=-1).indices

    @abc.abstractmethod
    def reference(self, rows: torch.Tensor) -> torch.Tensor:
        """The kernel's numbers [n, out_features] from float64 products of the same integers (a test oracle; slow)."""

    @property
    def nbytes(self) -> int:
        """Bytes one product reads from memory (every buffer)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def state(self) -> dict:
        """The packed buffers and sizes (``restore`` rebuilds the layer from them without quantizing again)."""
        return {"format": self.format, "in": self.in_features, "out": self.out_features} | dict(self.named_buffers())

    @staticmethod
    def restore(state: dict) -> Packed:
        layer = FORMATS[state["format"]].__new__(FORMATS[state["format"]])
        torch.nn.Module.__init__(layer)
        layer.in_features, layer.out_features = state["in"], state["out"]
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                layer.register_buffer(name, value)
        layer.restored()
        return layer

    def restored(self) -> None:
        """Set what the buffers imply (after ``restore``)."""


# Weight rows quantized at a time (a multiple of BLOCK): a layer's temporaries stay small, whatever its size.
CHUNK = 4096


class _Packer(Packed):
    """Packs a weight matrix in chunks of outputs into block-major buffers allocated once (memory: the result, plus
    one chunk's float32 temporaries)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if weight.dim() != 2 or 0 in weight.shape:
            raise ValueError(
                f"an {self.format} layer's weight must be a non-empty matrix, not of shape {tuple(weight.shape)}"
            )
        self.out_features, self.in_features = weight.shape
        self.check_width(self.in_features)
        blocks = -(-self.out_features // BLOCK)
        buffers: dict[str, torch.Tensor] = {}
        for start in range(0, self.out_features, CHUNK):
            chunk = weight[start : start + CHUNK].detach().float()
            if not bool(torch.isfinite(chunk).all()):
                raise ConfigError(
                    f"an {self.format} layer's weight holds NaN or infinite values: the model file is damaged, "
                    "download it again"
                )
            pad = -len(chunk) % BLOCK  # zero outputs up to a whole block, cut off again by linear()
            for name, part in self.pack(torch.nn.functional.pad(chunk, (0, 0, 0, pad))).items():
                if name not in buffers:
                    buffers[name] = torch.empty((blocks, *part.shape[1:]), dtype=part.dtype)
                buffers[name][start // BLOCK : start // BLOCK + len(part)] = part
        for name, buffer in buffers.items():
            self.register_buffer(name, buffer)
        self.restored()

    @abc.abstractmethod
    def check_width(self, width: int) -> None:
        """Raise a ValueError if the format cannot hold layers of ``width`` inputs."""

    @abc.abstractmethod
    def pack(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The buffers [blocks, ...] of float32 weight rows (a whole number of blocks)."""


class PackedInt8(_Packer):
    """int8 weights in VNNI blocks, a scale per output, int32 sums per group (activations: int8 per 128 inputs)."""

    format = "int8"

    def check_width(self, width: int) -> None:
        if not any(width % g == 0 for g in (GROUP, 64, 32)):
            raise ValueError(f"int8 layers need an input width that is a multiple of 32, not {width}")

    def pack(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        width, group = rows.shape[1], next(g for g in (GROUP, 64, 32) if rows.shape[1] % g == 0)
        w8, scale = quantize_rows(rows)
        scale = torch.where(rows.abs().amax(dim=1) == 0, torch.ones_like(scale), scale)  # padding rows: scale 1
        blocks = len(rows) // BLOCK
        sums = w8.reshape(blocks, BLOCK, width // group, group).sum(dim=3, dtype=torch.int32)
        return {
            "packed": w8.reshape(blocks, BLOCK, width // 4, 4).transpose(1, 2),
            "scale": scale.reshape(blocks, BLOCK),
            "group_sums": sums.transpose(1, 2),
        }

    def restored(self) -> None:
        self.group = self.in_features // self.group_sums.shape[1]

    def unpacked(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """int8 weight rows [start, stop) as [rows, in_features]."""
        blocks = self.packed[start // BLOCK : -(-(stop or self.packed.shape[0] * BLOCK) // BLOCK)]
        rows = blocks.transpose(1, 2).reshape(-1, self.in_features)
        return rows[start % BLOCK : start % BLOCK + (stop or rows.shape[0]) - start]

    def product(self, kernel, rows: torch.Tensor) -> torch.Tensor:
        return kernel.int8_linear(rows, self.packed, self.scale, self.group_sums, self.group)

    def argmax(self, kernel, rows: torch.Tensor) -> torch.Tensor:
        return kernel.int8_linear_argmax(rows, self.packed, self.scale, self.group_sums, self.group, self.out_features)

    def reference(self, rows: torch.Tensor) -> torch.Tensor:
        q, q_scale = quantize_rows(rows, self.group)
        sums = _group_sums(q, self.unpacked(0, self.out_features), self.group)  # [groups, n, out]
        acc = torch.zeros(len(rows), self.out_features)
        for g in range(len(sums)):
            acc = acc + sums[g] * q_scale[:, g : g + 1]
        return acc * self.scale.reshape(-1)[None, : self.out_features]


INT4_GROUP = 32  # weights per scale in the int4 format (and activations per scale with it)


class PackedInt4(_Packer):
    """4-bit weights (as llama.cpp's Q4_1: per 32 inputs of an output, a float16 step d and minimum m, w = d u + m with
    u in [0, 15]), multiplied with int8 activations (one scale per 32 inputs) by integer dot products. The minimum makes
    a group's grid fit its range; weights dequantized from a 4-bit GGUF (Q4_K's steps and minima) fit it closely."""

    format = "int4"

    def check_width(self, width: int) -> None:
        if width % INT4_GROUP:
            raise ValueError(f"int4 layers need an input width that is a multiple of {INT4_GROUP}, not {width}")

    def pack(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        u, step, least = quantize_int4(rows)
        blocks, groups = len(rows) // BLOCK, rows.shape[1] // INT4_GROUP
        # [block, output, group, vector t, nibble (low: quad 2t, high: 2t + 1), input]
        u = u.reshape(blocks, BLOCK, groups, 4, 2, 4)
        nibbles = u[:, :, :, :, 0] | (u[:, :, :, :, 1] << 4)  # [block, output, group, t, input]

        def per_block(values: torch.Tensor) -> torch.Tensor:
            return values.to(torch.float16).reshape(blocks, BLOCK, groups).transpose(1, 2)

        return {
            "packed": nibbles.permute(0, 2, 3, 1, 4).reshape(blocks, groups, 256),
            "steps": per_block(step),
            "minima": per_block(least),
        }

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The integers u [out, in] (uint8) and the steps and minima [out, in / 32] (float32)."""
        blocks, groups = self.packed.shape[:2]
        v = self.packed.reshape(blocks, groups, 4, BLOCK, 4).permute(0, 3, 1, 2, 4)  # [block, output, group, t, input]
        u = torch.stack([v & 0x0F, v >> 4], dim=4).reshape(blocks * BLOCK, self.in_features)

        def per_output(values: torch.Tensor) -> torch.Tensor:
            return values.transpose(1, 2).reshape(blocks * BLOCK, groups).float()[: self.out_features]

        return u[: self.out_features], per_output(self.steps), per_output(self.minima)

    def dequantized(self) -> torch.Tensor:
        """The weights the layer multiplies by, d u + m, float32 [out, in]."""
        u, step, least = self.unpacked()
        groups = u.reshape(self.out_features, -1, INT4_GROUP).float()
        return (groups * step[:, :, None] + least[:, :, None]).reshape(self.out_features, self.in_features)

    def product(self, kernel, rows: torch.Tensor) -> torch.Tensor:
        return kernel.int4_linear(rows, self.packed, self.steps, self.minima)

    def reference(self, rows: torch.Tensor) -> torch.Tensor:
        q, q_scale = quantize_rows(rows, INT4_GROUP)
        q_sum = q.reshape(len(rows), -1, INT4_GROUP).sum(dim=2, dtype=torch.int32).float()
        u, step, least = self.unpacked()
        sums = _group_sums(q, u, INT4_GROUP)  # [groups, n, out]
        acc = torch.zeros(len(rows), self.out_features)
        for g in range(len(sums)):
            dot = sums[g] * step[None, :, g] + least[None, :, g] * q_sum[:, g : g + 1]
            acc = acc + dot * q_scale[:, g : g + 1]
        return acc


FORMATS: dict[str, type[Packed]] = {"int8": PackedInt8, "int4": PackedInt4}


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group of 32 inputs of an output: integers u in [0, 15] (uint8 [out, in]) and the step d and minimum m
    (float32 [out, in / 32], float16 values) of w = d u + m covering the group: m its least value rounded down to
    float16, d the rest of its range / 15, rounded up where rounding to nearest would leave the largest value past
    the grid's end (small steps are float16 subnormals, coarse enough for that clipping to cost:
    benchmarks/int4_grids.py). Weights already on such a grid keep it exactly."""
    groups = weight.float().reshape(weight.shape[0], -1, INT4_GROUP)
    low, top = groups.amin(dim=2), groups.amax(dim=2)
    if not bool(torch.isfinite(low.half()).all() and torch.isfinite(top.half()).all()):
        raise ValueError("an int4 layer's weights exceed float16's range (65504): use --native-format int8")
    least16 = low.to(torch.float16)
    least16 = torch.where(least16.float() > low, _next_half(least16, float("-inf")), least16)
    step16 = ((top - least16.float()) / 15).to(torch.float16)
    step16 = torch.where(least16.float() + 15 * step16.float() < top, _next_half(step16, float("inf")), step16)
    if not bool(torch.isfinite(least16).all() and torch.isfinite(step16).all()):
        raise ValueError("an int4 layer's weights exceed float16's range (65504): use --native-format int8")
    least, step = least16.float(), step16.float()
    safe = torch.where(step == 0, torch.ones_like(step), step)
    u = torch.round((groups - least[:, :, None]) / safe[:, :, None]).clamp(0, 15).to(torch.uint8).reshape(weight.shape)
    return u, step, least


def _next_half(x: torch.Tensor, toward: float) -> torch.Tensor:
    """The float16 values next to float16 ``x`` toward ``toward``."""
    return torch.nextafter(x, torch.full_like(x, toward))


def _group_sums(q: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """Exact integer sums per group, [groups, n, out], from float64 products of int8 activations and weights."""
    q64 = q.double().reshape(len(q), -1, group)
    pieces = []
    for start in range(0, len(w), FALLBACK_ROWS):  # a slice of the weights at a time, not a float64 copy of all
        w64 = w[start : start + FALLBACK_ROWS].double().reshape(-1, q64.shape[1], group)
        pieces.append(torch.einsum("ngc,ogc->gno", q64, w64).float())
    return torch.cat(pieces, dim=2)


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and float32 scales (symmetric: largest magnitude 127), one per row or per ``group`` of its inputs."""
    x = x.float()
    groups = x.reshape(x.shape[0], -1, group or x.shape[1])
    scale = groups.abs().amax(dim=2).clamp(min=1e-8) / 127
    q = torch.round(groups / scale[:, :, None]).clamp(-127, 127).to(torch.int8).reshape(x.shape)
    return q, scale if group else scale[:, 0]


def linear(x: torch.Tensor, weights: Packed) -> torch.Tensor:
    """``x @ W.T`` in float32 with packed weights and int8 activations (see the module's docstring), for x [..., in]."""
    if x.shape[-1] != weights.in_features:
        raise ValueError(
            f"an {weights.format} layer of {weights.in_features} inputs got activations of width {x.shape[-1]}"
        )
    rows = x if x.dim() == 2 else x.reshape(-1, weights.in_features)
    if rows.dtype != torch.float32 or not rows.is_contiguous():  # (a call per layer: the common case costs nothing)
        rows = rows.float().contiguous()
    kernel = kernel_build.compiled() if rows.is_cpu else None
    if kernel is not None:
        kernel_build.on_cpu(weights.packed)  # its other buffers live where it does
        out = kernel_build.call(weights.product, kernel, rows)
        if out.shape[1] != weights.out_features:  # the last block's padding
            out = out[:, : weights.out_features]
    else:
        if not bool(torch.isfinite(rows).all()):
            raise ValueError(kernel_build.NON_FINITE)
        out = weights.reference(rows.cpu()).to(rows.device)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], weights.out_features)


def linear_argmax(x: torch.Tensor, weights: Packed) -> torch.Tensor:
    """``linear(x, weights).max(-1).indices`` (the first index of each row's largest output), long [n] for x [n, in];
    int8 finds it without writing the outputs: what a greedy step needs of the output head."""
    if x.dim() != 2 or x.shape[-1] != weights.in_features:
        raise ValueError(f"a layer of {weights.in_features} inputs got activations of shape {tuple(x.shape)}")
    rows = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    kernel = kernel_build.compiled() if rows.is_cpu else None
    if kernel is None:
        return linear(x, weights).max(dim=-1).indices
    kernel_build.on_cpu(weights.packed)
    return kernel_build.call(weights.argmax, kernel, rows)


def choose_format(config, format: str) -> tuple[str, str | None]:
    """``format`` itself, or for ``auto`` the faster format on this machine for the model's shape and why."""
    if format != "auto":
        return format, None
    chosen, why = measured_format(config)
    return chosen, f"--native-format auto chose {chosen}, measured on {why}"


MEASURE_BYTES = 2**30  # most int8 weight bytes the format measurement cycles through (beyond the caches here)
INT4_MIN_WEIGHTS = 10**9  # auto keeps smaller models on int8: small models lose the most perplexity to 4 bits


def measured_format(config) -> tuple[str, str]:
    """The faster native format on this machine for a model of this (text) config, and the figures that chose it.

    Copies of its MLP's [2 x FFN, width] matrix, as many as its layers' int8 bytes (at most ``MEASURE_BYTES``, so
    the caches hold what they would hold of the model), are multiplied at 1 and 9 positions (a step's cost and a
    verification's) in each format; int4 is chosen where it saves at least a tenth, for models of at least
    ``INT4_MIN_WEIGHTS`` weights. Cached per machine and shape.
    """
    from specdec.machine import fingerprint

    width, outputs = config.hidden_size, 2 * config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or width // config.num_attention_heads
    attention = 2 * (config.num_attention_heads + config.num_key_value_heads) * head_dim * width
    layer_bytes = config.num_hidden_layers * (3 * config.intermediate_size * width + attention)
    copies = max(1, min(layer_bytes, MEASURE_BYTES) // (width * outputs))
    weights = layer_bytes + config.vocab_size * width
    facts = [
        fingerprint(),
        torch.get_num_threads(),
        kernel_build.module_name(kernel_build.variant() or "avx512"),
        width,
        outputs,
        copies,
        weights,
    ]
    key = json.dumps(facts, sort_keys=True)
    record = cache_root() / "formats" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        found = json.loads(record.read_text())
        return found["format"], found["why"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    weight = torch.randn(outputs, width, generator=torch.Generator().manual_seed(0))
    costs = {format: _pass_times(FORMATS[format](weight), copies) for format in ("int8", "int4")}
    faster = "int4" if sum(costs["int4"]) < 0.9 * sum(costs["int8"]) else "int8"
    detail = ", ".join(f"{f} {a:.1f}/{b:.1f} ms" for f, (a, b) in costs.items())
    why = f"{copies} [{outputs} x {width}] matrices at 1/9 positions: {detail}"
    chosen = faster
    if faster == "int4" and weights < INT4_MIN_WEIGHTS:
        chosen, why = "int8", f"{why}; under {INT4_MIN_WEIGHTS / 1e9:.0f}B weights 4 bits cost too much perplexity"
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(record, json.dumps({"format": chosen, "why": why}).encode(), PUBLIC)
    except OSError:
        pass  # measured again next time
    return chosen, why


def _pass_times(packed: Packed, copies: int) -> list[float]:
    """Milliseconds for a product with each of ``copies`` copies of ``packed``, at 1 and 9 positions (best of 3)."""
    state = packed.state()
    layers = [packed] + [
        Packed.restore({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
        for _ in range(copies - 1)
    ]
    times = []
    for n in (1, 9):
        x = torch.randn(n, packed.in_features, generator=torch.Generator().manual_seed(n))
        best = float("inf")
        for _ in range(3):
            begin = time.perf_counter()
            for layer in layers:
                linear(x, layer)
            best = min(best, time.perf_counter() - begin)
        times.append(best * 1e3)
    return times
