"""Memory this process may still take: on a GPU, the device's free memory; on the host, the least of what the host
has available and what its cgroup's limit leaves (in a container the host figure counts memory the container may not
use, and going past the limit gets the process killed)."""

from __future__ import annotations

from pathlib import Path

import psutil
import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")  # where the cgroup file system is mounted
PROC_CGROUP = Path("/proc/self/cgroup")  # which cgroup this process is in


def available_bytes(device: torch.device) -> int:
    """Bytes that allocations on ``device`` may still take: free device memory on CUDA (with what PyTorch's allocator
    holds unused), else the host's available memory capped by the cgroup's limit."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    host = psutil.virtual_memory().available
    limited = cgroup_available()
    return host if limited is None else min(host, limited)


def cgroup_available() -> int | None:
    """Bytes this process's cgroup, and each cgroup above it, may still take before its memory limit; None where no
    limit is set or none can be read (no cgroup file system: not Linux, or not mounted).

    cgroup v2: memory.max less memory.current; v1: memory.limit_in_bytes less memory.usage_in_bytes. Usage counts the
    page cache, of which the inactive file pages (memory.stat) are reclaimed before the limit is enforced: they count
    as available.
    """
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        parts = line.split(":", 2)  # hierarchy id, controllers, path
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: one hierarchy for every controller
            found += _headroom(CGROUP_ROOT, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            root = CGROUP_ROOT / controllers
            found += _headroom(root, path, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    return min(found) if found else None


def _headroom(root: Path, path: str, limit_file: str, usage_file: str, reclaimable: str) -> list[int]:
    """Limit less usage of the cgroup at ``path`` under ``root`` and of each one above it, where a limit is set.

    Inside a container the process's cgroup path is often the host's while the container's own cgroup is mounted at
    ``root``: a path that is not there is read at ``root``."""
    folder = root / path.lstrip("/")
    if not folder.is_dir():
        folder = root
    headroom = []
    while True:
        limit, usage = _read_int(folder / limit_file), _read_int(folder / usage_file)
        if limit is not None and usage is not None:
            headroom.append(max(limit - usage + _stat(folder / "memory.stat", reclaimable), 0))
        if folder == root or root not in folder.parents:
            return headroom
        folder = folder.parent


def _read_int(file: Path) -> int | None:
    """The number in ``file``; None where it is missing, unreadable or "max" (no limit)."""
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(file: Path, key: str) -> int:
    """``key``'s value in a memory.stat file (0 where it is missing)."""
    try:
        lines = file.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0
