"""A stand-in accelerator for machines without one: tensors that hold host data but live "on" another device.

Inside :class:`FakeDevice`, an operation that mixes a tensor on the fake
device with a host tensor raises as CUDA does (host scalars and host index
tensors are allowed, as CUDA allows them), and a random draw on one device
with a generator of another raises too. Models run on the host through
:class:`OnFakeDevice`, which hands their outputs back on the fake device, so
the engine code between the model and the verifier is checked operand by operand.
One blind spot: ``torch.tensor(data, device=...)`` bypasses dispatch and makes
an empty meta tensor; code under test writes ``torch.tensor(data).to(device)``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from specdec.models.backend import OneRow

DEVICE = torch.device("meta")  # what the fake device's tensors report as their device
# a generator of the fake device is a host generator seeded at or above this (dispatch hands out new wrappers)
FAKE_SEEDS = 1 << 48
HOST_INDICES_ALLOWED = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
}


class Remote(torch.Tensor):
    """Host data that claims to live on the fake device."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor) -> Remote:
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, host.shape, strides=host.stride(), dtype=host.dtype, device=DEVICE
        )
        tensor.host = host
        return tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # only reached outside FakeDevice
        raise RuntimeError(f"{func} on a fake-device tensor outside FakeDevice")


def to_host(value: Any) -> Any:
    return value.host if isinstance(value, Remote) else value


def to_remote(value: Any) -> Any:
    return Remote(value) if isinstance(value, torch.Tensor) and not isinstance(value, Remote) else value


class FakeDevice(TorchDispatchMode):
    """Runs every operation on the host while checking that its operands share a device, as an accelerator would."""

    def __init__(self) -> None:
        super().__init__()
        self.operations = 0

    @staticmethod
    def generator(seed: int) -> torch.Generator:
        """A generator of the fake device: it draws what a host generator seeded ``FAKE_SEEDS + seed`` draws."""
        return torch.Generator().manual_seed(FAKE_SEEDS + seed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.operations += 1
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        remote = [isinstance(t, Remote) for t in tensors]
        if "device" in kwargs and kwargs["device"] is not None:
            on_fake = torch.device(kwargs["device"]) == DEVICE
        else:
            on_fake = any(remote)
        if any(remote) and not all(remote):
            host = [t for t, r in zip(tensors, remote, strict=True) if not r and t.dim() > 0]
            if (
                host
                and func not in HOST_INDICES_ALLOWED
                and func not in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
            ):
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found the fake device and cpu ({func})"
                )
        generator = kwargs.get("generator")
        if generator is not None and (generator.initial_seed() >= FAKE_SEEDS) != on_fake:
            raise RuntimeError(f"Expected a generator of the {'fake' if on_fake else 'cpu'} device ({func})")
        if on_fake and "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        out = func(*tree_map(to_host, args), **tree_map(to_host, kwargs))
        if func is torch.ops.aten.copy_.default and isinstance(args[0], Remote):
            return args[0]
        return tree_map(to_remote, out) if on_fake else out


class OnFakeDevice:
    """A backend (single-sequence or batched) whose model runs on the host; its logits come back on the fake device."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.info = replace(inner.info, device=DEVICE)
        self.device = DEVICE

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with _disable_current_modes():
            args, kwargs = tree_map(to_host, args), tree_map(to_host, kwargs)
            return Remote(self.inner.forward(*args, **kwargs))

    def fork(self) -> OnFakeDevice:
        return OnFakeDevice(self.inner.fork())

    def row_backend(self, *, batch: bool, trees: bool = False, cuda_graphs: bool = True) -> OneRow:
        """Rows over this wrapper, so that the logits of a single sequence's steps come back on the fake device too."""
        return OneRow(self.fork() if batch else self)
