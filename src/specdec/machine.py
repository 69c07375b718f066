"""What machine this is, in the few facts that decide which configuration is fastest on it."""

from __future__ import annotations

import os
import platform

import torch


def cpu_name() -> str:
    """The CPU's model name ("AMD EPYC 9R14"), from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``avx512_vnni``, ``amx_int8``, ...) from /proc/cpuinfo; empty where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            line = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def fingerprint() -> dict[str, str | int]:
    """The facts a tuned profile depends on: CPU, core count, accelerator."""
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count() or 1,
        "accelerator": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }
