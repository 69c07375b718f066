"""The llama.cpp backend: a GGUF model run by llama.cpp through llama-cpp-python's C bindings.

llama.cpp is the fastest CPU runtime for these models; running the engine on it
lets drafters and the verifier multiply its speed. Logits come back as float32
arrays for only the positions verification reads.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from specdec.atomic import PUBLIC, atomic_write_bytes
from specdec.errors import ConfigError, MissingPackageError
from specdec.machine import cpu_flags, cpu_name
from specdec.models.backend import TREES_UNSUPPORTED, Backend, BackendCapabilities, Embed, ModelInfo

INSTALL = 'pip install -e ".[llamacpp]"  (builds llama.cpp from source: about 5-15 minutes on 2 cores)'
# llama.cpp built for AVX-512 without -march=native: no AMX, which faults in some VMs
PORTABLE_FLAGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON "
    "-DGGML_FMA=ON -DGGML_F16C=ON"
)
PROBE_TIMEOUT_S = 300
CRASHES = ("SIGSEGV", "SIGILL", "SIGBUS", "SIGABRT", "SIGFPE")  # a build's own faults (SIGKILL, SIGTERM: from outside)
# Loads a GGUF file as the backend does (every core, swa_full) and decodes a many-token batch, then one token: the calls
# that crash a miscompiled build.
PROBE = """
import os, sys, llama_cpp
cores = os.cpu_count() or 1
llama = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_batch=512, n_ubatch=512, n_threads=cores,
                        n_threads_batch=cores, swa_full=True, verbose=False)
llama.eval(llama.tokenize(b"def add(a, b):\\n    return a + b", add_bos=True)[:12])
llama.eval([llama.token_eos()])
"""


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def require_llama_cpp():
    """The llama_cpp module, once it is installed and known not to crash on this machine (else a one-line error)."""
    if not llama_cpp_installed():
        raise MissingPackageError(f"the llama.cpp backend needs llama-cpp-python: run `{INSTALL}`")
    problem = llama_cpp_problem()
    if problem is not None:
        raise ConfigError(problem)
    import llama_cpp

    return llama_cpp


def llama_cpp_problem() -> str | None:
    """Why llama.cpp cannot be used here (a one-line message with the fix), or None if it runs.

    A llama-cpp-python build can kill its process in native code (seen: a build with ``-march=native`` faults in
    ggml's AMX kernel on an Intel Xeon with AMX). So before any process of specdec loads it, a subprocess decodes a
    few tokens of the bundled GGUF; a verdict of "runs" or "crashes" is cached on disk per machine and build.
    """
    if not llama_cpp_installed():
        return f"llama-cpp-python is not installed: run `{INSTALL}`"
    return _probe_verdict(build_identity())


def rebuild_command() -> str:
    """The command that rebuilds the installed llama-cpp-python without this machine's native instructions."""
    try:
        version = "==" + importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        version = ""
    pip = "pip install --force-reinstall --no-cache-dir --no-deps"
    return f'CMAKE_ARGS="{PORTABLE_FLAGS}" {pip} llama-cpp-python{version}'


@functools.cache
def build_identity() -> str:
    """This machine's CPU and the installed llama-cpp-python's files (names, sizes, times): a rebuild changes it."""
    spec = importlib.util.find_spec("llama_cpp")
    folders = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    kinds = (".so", ".dylib", ".dll", ".py")
    files = sorted(f for folder in folders for f in folder.rglob("*") if f.is_file() and f.suffix in kinds)
    stamps = (f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    return hashlib.sha256("\n".join([cpu_name(), " ".join(sorted(cpu_flags())), *stamps]).encode()).hexdigest()[:16]


@functools.cache
def _probe_verdict(identity: str) -> str | None:
    from specdec.models.registry import ALIASES, cache_root

    record = cache_root() / "probes" / f"llama_cpp-{identity}.json"
    try:
        return json.loads(record.read_text())["problem"]
    except (OSError, ValueError, KeyError):
        pass
    problem, lasting = _run_probe(str(ALIASES["gemma-3-270m"].locate_gguf()))
    if lasting:  # a crash or a clean run; an error, a time-out or a kill may pass, so the next process probes again
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            # whole or absent, whatever other processes probe at the same time
            atomic_write_bytes(record, json.dumps({"problem": problem}).encode(), PUBLIC)
        except OSError:
            pass  # an unwritable cache: the next process probes again
    return problem


def _run_probe(gguf: str) -> tuple[str | None, bool]:
    """The probe's verdict (None: llama.cpp runs) and whether it lasts as long as this build and machine."""
    command = [sys.executable, "-P", "-c", PROBE, gguf]  # -P: not a llama_cpp folder in the working directory
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"llama.cpp did not decode 12 tokens within {PROBE_TIMEOUT_S} s here: try `{rebuild_command()}`", False
    if done.returncode == 0:
        return None, True
    if done.returncode < 0:
        try:
            how = signal.Signals(-done.returncode).name
        except ValueError:
            how = f"signal {-done.returncode}"
        if how not in CRASHES:
            return f"llama.cpp's probe was stopped by {how} (from outside, such as the out-of-memory killer)", False
        return (
            f"this llama-cpp-python build crashes on this CPU ({cpu_name()}): its decode dies with {how} (a build for "
            f"this machine's native instructions, such as AMX, can fault in a VM); rebuild it without them: "
            f"`{rebuild_command()}`"
        ), True
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    reason = lines[-1] if lines else f"exit code {done.returncode}"
    return f"llama.cpp fails to decode on this machine ({reason}): try `{rebuild_command()}`", False


def end_of_generation_ids(llama) -> frozenset[int]:
    """Every token llama.cpp treats as ending generation (EOS, end-of-turn, ...)."""
    llama_cpp = require_llama_cpp()
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    return frozenset(t for t in range(llama.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t))


class LlamaCppTokenizer:
    """llama.cpp's own tokenizer behind the small interface the engine uses."""

    def __init__(self, llama) -> None:
        self.llama = llama
        self.eos_token_id: int = llama.token_eos()

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.llama.tokenize(text.encode("utf-8"), add_bos=add_special_tokens, special=True)}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.llama.detokenize(ids, special=not skip_special_tokens).decode("utf-8", errors="replace")


class LlamaCppBackend(Backend):
    """One sequence (id 0) in a llama.cpp context; rollback removes cache positions past the accepted prefix.

    ``ubatch`` is llama.cpp's micro-batch: the most tokens one kernel call
    computes. Its quantized kernels round a many-token forward slightly
    differently from a one-token forward, which can flip a near-tie in greedy
    decoding; ``ubatch=1`` makes verification compute exactly what one-token
    decoding computes (bit-identical greedy output) at the price of the batching speed-up.
    """

    _batch = None  # llama.cpp's token batch, freed by __del__ (None until allocated: __init__ may fail before)

    def __init__(
        self, gguf: str, threads: int | None = None, context: int = 4096, batch: int = 512, ubatch: int | None = None
    ) -> None:
        llama_cpp = require_llama_cpp()
        threads = threads or os.cpu_count() or 1
        self._lib = llama_cpp
        # swa_full keeps every position of sliding-window layers, so that a rejected run can be removed.
        self.llama = llama_cpp.Llama(
            model_path=gguf,
            n_ctx=context,
            n_batch=batch,
            n_ubatch=ubatch or batch,
            n_threads=threads,
            n_threads_batch=threads,
            swa_full=True,
            verbose=False,
        )
        self.threads = threads
        # llama.cpp runs on a thread pool of its own, fixed here: torch's thread count does not decide its speed.
        self.info = ModelInfo(
            name=(
                f"llama.cpp|{os.path.abspath(gguf)}|{os.path.getsize(gguf)}|threads={threads}|ubatch={ubatch or batch}"
            ),
            vocab_size=self.llama.n_vocab(),
            max_context=self.llama.n_ctx(),
            capabilities=BackendCapabilities(features=True),
            torch_threads=False,
        )
        self._batch_size = batch
        self._batch = llama_cpp.llama_batch_init(batch, 0, 1)
        self._memory = llama_cpp.llama_get_memory(self.llama.ctx)
        self._length = 0
        self._embeddings = False  # whether llama.cpp is asked for hidden states too
        self._embedding: tuple[torch.Tensor, float] | None = None  # the input embedding table, read on first use
        self.gguf = gguf
        self.last_features: torch.Tensor | None = None
        self.eos_ids = end_of_generation_ids(self.llama)
        self.tokenizer = LlamaCppTokenizer(self.llama)

    def __del__(self) -> None:
        if self._batch is not None:
            self._lib.llama_batch_free(self._batch)
            self._batch = None

    @property
    def cached_length(self) -> int:
        return self._length

    def fork(self) -> LlamaCppBackend:
        raise ConfigError(
            "a llama.cpp model decodes one sequence per context: for batched generation use a transformers draft "
            "(--draft model:NAME), a model-free drafter (prompt-lookup, ngram:FILE), and --runtime transformers"
        )

    def reset(self) -> None:
        self._lib.llama_memory_clear(self._memory, True)
        self._length = 0

    def token_embeddings(self) -> Embed:
        """The model's input embedding as a function of token ids, read once from the GGUF file (a feature-conditioned
        draft embeds with it)."""
        if self._embedding is None:
            from gguf import GGUFReader
            from gguf.quants import dequantize

            tensor = next(t for t in GGUFReader(self.gguf).tensors if t.name == "token_embd.weight")
            rows = dequantize(tensor.data, tensor.tensor_type).reshape(self.vocab_size, -1)
            scale = (
                self.llama.n_embd() ** 0.5 if "gemma" in self.llama.metadata.get("general.architecture", "") else 1.0
            )
            self._embedding = (torch.from_numpy(np.ascontiguousarray(rows)).to(torch.bfloat16), scale)
        table, scale = self._embedding
        return lambda ids: table[ids.cpu()].float() * scale

    def forward(
        self, tokens: torch.Tensor, last: int | None = None, tree: torch.Tensor | None = None, features: bool = False
    ) -> torch.Tensor:
        """Logits for the ``last`` positions; when they all come from one llama_decode call they are
        returned without a copy, as a view of llama.cpp's buffer that stays valid until the next forward.

        With ``features``, llama.cpp also returns its final hidden states (its "embeddings", after the final norm) from
        the same decode; it returns them only for positions it computes logits for, so every fed position gets both.
        """
        if tree is not None:
            raise ConfigError(TREES_UNSUPPORTED)
        ids = tokens[0].tolist()
        count = len(ids)
        wanted = count if last is None or features else min(last, count)
        if features != self._embeddings:
            self._lib.llama_set_embeddings(self.llama.ctx, features)
            self._embeddings = features
        # logits rows returned: with features every row is computed, few kept
        kept = count if last is None else min(last, count)
        pieces, states = [], []
        for start in range(0, count, self._batch_size):
            outputs = self._decode(ids[start : start + self._batch_size], start, first_output=count - wanted)
            if outputs:
                pointer = self._lib.llama_get_logits(self.llama.ctx)
                if not pointer:
                    raise RuntimeError(
                        "this llama.cpp build returns no logits while it returns hidden states: "
                        "upgrade llama-cpp-python"
                    )
                first_row = max(count - wanted, start)  # the position of this chunk's first logits row
                view = np.ctypeslib.as_array(pointer, shape=(outputs, self.vocab_size))[
                    max(0, count - kept - first_row) :
                ]
                final = start + self._batch_size >= count
                if len(view):
                    pieces.append(view if final else view.copy())  # the next chunk's decode overwrites the buffer
                if features:
                    hidden = self._lib.llama_get_embeddings(self.llama.ctx)
                    states.append(np.ctypeslib.as_array(hidden, shape=(outputs, self.llama.n_embd())).copy())
        self._length += count
        logits = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        self.last_features = torch.from_numpy(np.concatenate(states))[None] if features else None
        return torch.from_numpy(logits)[None]

    def _decode(self, chunk: list[int], start: int, first_output: int) -> int:
        """Append one batch of tokens at positions after the cache; return how many logits rows it produced."""
        batch = self._batch
        batch.n_tokens = len(chunk)
        outputs = 0
        for i, token in enumerate(chunk):
            batch.token[i] = token
            batch.pos[i] = self._length + start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = wants = start + i >= first_output
            outputs += wants
        status = self._lib.llama_decode(self.llama.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed (status {status}) at position {self._length + start}")
        return outputs

    def truncate(self, length: int, branch: list[int] | None = None) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} positions to {length}")
        if branch is not None and branch != list(range(length - len(branch), length)):
            raise ConfigError(TREES_UNSUPPORTED)
        if length < self._length and not self._lib.llama_memory_seq_rm(self._memory, 0, length, -1):
            raise RuntimeError("llama.cpp could not remove rejected positions from this model's cache")
        self._length = length
