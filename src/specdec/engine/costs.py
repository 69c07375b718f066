"""The cost of one target forward over n tokens, measured on this machine and runtime.

Whether speculating k tokens pays depends on how the price of verifying k + 1
tokens compares with one token: nearly flat for transformers in bfloat16 here,
steep for llama.cpp. k policies and the benchmark read this curve instead of assuming it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch

from specdec.atomic import PUBLIC, atomic_write_bytes
from specdec.drafters.base import Drafter
from specdec.errors import ConfigError
from specdec.machine import fingerprint
from specdec.models.backend import Backend, RowBackend
from specdec.models.registry import cache_root
from specdec.scheduling import BatchCostCurve, CostCurve

DEFAULT_SIZES = (1, 2, 3, 5, 9, 13, 17)  # k + 1 for k = 0, 1, 2, 4, 8, 12, 16
TREE_SIZES = (3, 5, 9, 13, 17)  # the pending token and 2 .. 16 tree nodes
# a tree's extra cost grows with the context its nodes see; this is about a benchmark prompt and its answer
TREE_CONTEXT = 256
BATCH_ROWS = (1, 2, 4, 8, 16, 32)
BATCH_SIZES = (1, 2, 3, 5, 9)
# A measurement is kept on disk only when other processes used at most this share of the machine's CPU time meanwhile,
# and the costs rise with the work (within NOISE): a curve taken under load would otherwise price every later run.
MOST_OTHER_LOAD = 0.15
NOISE = 0.85
MEASURE_ATTEMPTS = 2
# /proc counts in ticks (10 ms): a short measurement sees a daemon's single tick as a large share
TICK_SLACK = 3

log = logging.getLogger(__name__)


def forward_cost_curve(
    backend: Backend, sizes: tuple[int, ...] = DEFAULT_SIZES, context: int = 64, repeats: int = 5
) -> dict[int, float]:
    """Median seconds of a forward over n new tokens (logits for all n) after ``context`` cached tokens.

    The sizes take turns, one forward each per round: a stretch of load from elsewhere (a compiler, another process)
    then slows every size alike instead of making a few look dearer than bigger ones.
    """
    vocab = backend.vocab_size
    tokens = torch.arange(context + max(sizes), dtype=torch.long)[None] % vocab
    backend.reset()
    backend.forward(tokens[:, :context], last=1)
    backend.forward(tokens[:, context : context + 1], last=1)  # warm-up
    backend.truncate(context)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            start = _clock()
            backend.forward(tokens[:, context : context + n], last=n)
            times[n].append(_clock() - start)
            backend.truncate(context)
    backend.reset()
    return {n: statistics.median(t) for n, t in times.items()}


def tree_overhead_curve(
    rows: RowBackend, sizes: tuple[int, ...] = TREE_SIZES, context: int = TREE_CONTEXT, repeats: int = 7
) -> dict[int, float]:
    """Median extra seconds of a forward over n new tokens whose last n - 1 are a tree of drafts, over the same forward
    as a chain.

    A tree's nodes each see only their ancestors, so a runtime lays out their attention apart from a chain's
    (models/precision.py); the chain cost curve does not know that. The tree is a drafter's top branches: two roots,
    every node two children. Chain and tree take turns on one cache row, so both see the same load; 0 at n = 1.
    """
    vocab = rows.vocab_size
    tokens = torch.arange(context + max(sizes), dtype=torch.long) % vocab
    rows.add_rows(1)
    rows.forward([0], [tokens[:context]], last=1)
    times: dict[tuple[int, bool], list[float]] = {(n, tree): [] for n in sizes for tree in (False, True)}
    for round_ in range(repeats + 1):  # the first round warms up
        for n in sizes:
            parents = torch.tensor([-1 if i < 2 else (i - 2) // 2 for i in range(n - 1)])
            for tree in (False, True):
                start = _clock()
                rows.forward([0], [tokens[context : context + n]], last=n, trees=[parents if tree else None])
                if round_:
                    times[n, tree].append(_clock() - start)
                rows.truncate(0, context)
    rows.remove_rows([0])
    extra = {n: max(0.0, statistics.median(times[n, True]) - statistics.median(times[n, False])) for n in sizes}
    return {1: 0.0, **extra}


def batch_cost_curve(
    backend: RowBackend,
    rows: tuple[int, ...] = BATCH_ROWS,
    sizes: tuple[int, ...] = BATCH_SIZES,
    context: int = 64,
    repeats: int = 3,
) -> BatchCostCurve:
    """Median seconds of a forward over B rows of n new tokens each, after ``context`` cached tokens per row."""
    tokens = torch.arange(context + max(sizes), dtype=torch.long) % backend.vocab_size
    curves = {}
    for count in rows:
        backend.add_rows(count)
        ids = list(range(count))
        backend.forward(ids, [tokens[:context]] * count, last=1)
        # warm-up, and the cache grown to its widest
        backend.forward(ids, [tokens[context : context + max(sizes)]] * count, last=1)
        for row in ids:
            backend.truncate(row, context)
        seconds = {}
        for n in sizes:
            times = []
            for _ in range(repeats):
                start = _clock()
                backend.forward(ids, [tokens[context : context + n]] * count, last=n)
                times.append(_clock() - start)
                for row in ids:
                    backend.truncate(row, context)
            seconds[n] = statistics.median(times)
        backend.remove_rows(ids)
        curves[count] = CostCurve(seconds)
    return BatchCostCurve(curves)


def machine_cost_curve(backend: Backend) -> CostCurve:
    """This backend's cost curve on this machine: measured once (a few seconds), cached where plausible (_cached)."""
    stored = _cached(
        backend.identity, lambda: {str(n): s for n, s in forward_cost_curve(backend).items()}, _falling_cost
    )
    return CostCurve({int(n): s for n, s in stored.items()})


def machine_tree_overhead(rows: RowBackend) -> CostCurve:
    """What a tree costs beyond a chain on this runtime (``tree_overhead_curve``): measured once (many forwards of the
    model), cached where plausible."""
    stored = _cached(
        f"{rows.identity}|tree overhead", lambda: {str(n): s for n, s in tree_overhead_curve(rows).items()}
    )
    return CostCurve({int(n): s for n, s in stored.items()})


def machine_draft_step(drafter: Drafter, branches: int = 1) -> float:
    """Seconds of one draft step (a level of ``branches`` nodes) of a drafter that runs a model outside a Backend
    (``measure_step``, the eagle head): measured once (a few runs of its model), cached where plausible under its
    ``identity``."""
    stored = _cached(f"{drafter.identity}|draft step|{branches}", lambda: {"1": drafter.measure_step(branches)})
    return stored["1"]


def batch_rows(max_rows: int | None) -> tuple[int, ...]:
    """The row counts a batch of at most ``max_rows`` rows (None: any) is priced by: BATCH_ROWS up to the first that
    covers it (the curve is proportional beyond its last)."""
    if max_rows is None:
        return BATCH_ROWS
    covering = next((rows for rows in BATCH_ROWS if rows >= max_rows), BATCH_ROWS[-1])
    return tuple(rows for rows in BATCH_ROWS if rows <= covering)


def machine_batch_cost_curve(backend: RowBackend, rows: tuple[int, ...] = BATCH_ROWS) -> BatchCostCurve:
    """The batched backend's cost over ``rows`` and tokens on this machine: measured once (batched forwards of the
    model, more the more rows), cached where plausible."""

    def measure() -> dict[str, dict[str, float]]:
        curve = batch_cost_curve(backend, rows)
        return {str(rows): {str(n): s for n, s in c.seconds.items()} for rows, c in curve.by_rows.items()}

    def falling(stored: dict[str, dict[str, float]]) -> str | None:
        by_rows = {int(rows): {int(n): s for n, s in c.items()} for rows, c in stored.items()}
        curves = [(c, f"{rows} rows, by tokens") for rows, c in by_rows.items()]
        sizes = next(iter(by_rows.values()))
        curves += [({rows: c[n] for rows, c in by_rows.items()}, f"{n} tokens a row, by rows") for n in sizes]
        return next((why for curve, what in curves if (why := _falling_cost(curve, what))), None)

    stored = _cached(f"{backend.identity}|rows {','.join(map(str, rows))}", measure, falling)
    return BatchCostCurve({int(rows): CostCurve({int(n): s for n, s in c.items()}) for rows, c in stored.items()})


class MachineCosts:
    """What one Generator's k policies and batch k_cap price steps by on this machine: the target's forward cost
    curve, a tree's overhead, a draft step's seconds and the batched forward's cost, each measured on first use (once,
    whichever thread asks first, on a copy of the model or rows of its own so no run's cache is disturbed), then kept
    in memory and, where plausible, on disk."""

    def __init__(self, backend: Backend, cuda_graphs: bool = True) -> None:
        self.backend, self.cuda_graphs = backend, cuda_graphs
        self._lock = threading.Lock()
        self._forward: CostCurve | None = None
        self._tree_overhead: CostCurve | None = None
        self._draft_step: dict[tuple[str, int], float] = {}  # by what drafts and branches
        self._batch: dict[tuple[str, tuple[int, ...]], BatchCostCurve] = {}  # by the rows' identity and counts

    def forward(self) -> CostCurve:
        """The target's forward cost curve."""
        with self._lock:
            if self._forward is None:
                self._forward = machine_cost_curve(quiet_copy(self.backend))
        return self._forward

    def tree_overhead(self) -> CostCurve:
        """A tree forward's seconds over a chain's, on the rows a single sequence drafts trees in."""
        with self._lock:
            if self._tree_overhead is None:
                rows = quiet_copy(self.backend).row_backend(batch=False, trees=True, cuda_graphs=self.cuda_graphs)
                self._tree_overhead = machine_tree_overhead(rows)
        return self._tree_overhead

    def batch(self, rows: RowBackend, max_rows: int | None = None) -> BatchCostCurve:
        """The cost of a forward over B rows of n tokens on ``rows``, a batched backend of this target with no rows,
        for batches of at most ``max_rows`` rows (None: any)."""
        key = (rows.identity, batch_rows(max_rows))
        with self._lock:
            if key not in self._batch:
                self._batch[key] = machine_batch_cost_curve(rows, key[1])
        return self._batch[key]

    def draft_step(self, drafter: Drafter, branches: int = 1) -> float:
        """Seconds of one of ``drafter``'s steps drafting ``branches`` nodes a level: the draft model's one-token
        forward, the drafter's own measure for a model outside a Backend (the eagle head, whose tree levels cost more
        than a chain's), 0 for model-free drafters."""
        measured = drafter.capabilities.measures_steps
        branches = branches if measured else 1  # a draft model's step is its one-token forward, however wide
        key = (drafter.backend.identity if drafter.backend is not None else drafter.identity, branches)
        with self._lock:
            if key not in self._draft_step:
                if drafter.backend is not None:
                    self._draft_step[key] = machine_cost_curve(quiet_copy(drafter.backend))(1)
                elif measured:
                    self._draft_step[key] = machine_draft_step(drafter, branches)
                else:
                    self._draft_step[key] = 0.0
        return self._draft_step[key]


def quiet_copy(backend: Backend) -> Backend:
    """A backend to measure costs on without touching ``backend``'s cache: a fork, or the backend itself where it
    cannot fork (llama.cpp, which also refuses a second live completion, so nobody else is using it)."""
    try:
        return backend.fork()
    except ConfigError:
        return backend


def _cached(identity: str, measure: Callable[[], dict], problem: Callable[[dict], str | None] = lambda _: None) -> dict:
    """Measurements of ``identity`` on this machine (its fingerprint), taken by ``measure`` once and kept on disk.

    A measurement that other processes' load may have distorted, or that ``problem`` finds implausible, is taken again
    (MEASURE_ATTEMPTS in all); if every attempt is suspect the last is used by this process only, with a warning, and
    the next process measures again.
    """
    key = "|".join(str(fact) for fact in fingerprint().values()) + f"|{identity}"
    path = cache_root() / "costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.exists():
        return json.loads(path.read_text())["seconds"]
    for _ in range(MEASURE_ATTEMPTS):
        others = OtherLoad()
        seconds = measure()
        why = others.problem() or problem(seconds)
        if why is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, json.dumps({"key": key, "seconds": seconds}, indent=1).encode(), PUBLIC)
            return seconds
    log.warning("costs of %s not cached (%s): this process uses them, the next measures again", identity, why)
    return seconds


def _falling_cost(seconds: dict, what: str = "by tokens") -> str | None:
    """Why a cost curve over growing work (sizes to seconds) cannot be right: it falls by more than noise."""
    points = sorted((int(n), s) for n, s in seconds.items())
    for (n, s), (m, t) in itertools.pairwise(points):
        if t < NOISE * s:
            return f"{what}: {m} measured cheaper than {n} ({t * 1e3:.1f} ms < {s * 1e3:.1f} ms)"
    return None


class OtherLoad:
    """How much of the machine's CPU time other processes take from now on (Linux's /proc; elsewhere nothing is
    seen)."""

    def __init__(self) -> None:
        self.start = _cpu_times()

    def problem(self) -> str | None:
        """Why a measurement since construction is suspect (others used over MOST_OTHER_LOAD of the CPU), or None."""
        end = _cpu_times()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        total, busy, own = (b - a for a, b in zip(self.start, end, strict=True))
        share = max(0, busy - own - TICK_SLACK) / total
        if share > MOST_OTHER_LOAD:
            return f"other processes used {share:.0%} of the CPU while it was measured"
        return None


def _cpu_times() -> tuple[int, int, int] | None:
    """Clock ticks since boot: the total and busy ticks of the CPUs this process may run on (steal included: a
    hypervisor's other guests), and this process's own (all its threads); None without /proc."""
    try:
        allowed = {f"cpu{n}" for n in os.sched_getaffinity(0)}
        with open("/proc/stat", encoding="ascii") as stat:
            lines = [line.split() for line in stat if line.split()[0] in allowed]
        fields = [sum(int(line[i]) for line in lines) for i in range(1, 9)]
        with open("/proc/self/stat", encoding="ascii") as own:
            after_name = own.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError, AttributeError):  # no sched_getaffinity outside Linux
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return sum(fields), user + nice + system + irq + softirq + steal, int(after_name[11]) + int(after_name[12])


def _clock() -> float:
    """Seconds, after the accelerator has finished what was queued (a CUDA forward returns before its kernels run)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()
