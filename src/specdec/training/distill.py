"""Distil a draft for a target: score text with the target, then teach a small draft to match it.

Two phases, both resumable from the output folder:

1. Teacher data. Corpus text (files, folders, JSONL continuations) and the
   target's own continuations of prompt-only JSONL records (on-policy) are
   tokenized into fixed-length chunks; the target scores every position once and
   keeps only its top-k distribution over the draft's kept tokens (indices int32,
   log-probabilities float16: 6 bytes per entry, so millions of tokens fit).
   Or a `specdec distill-data` folder (``teacher_data``): the target's own
   batched writing with its hidden states, scored from those states.
2. Training. Teacher-forced soft cross-entropy (the KL divergence up to a
   constant) between the stored top-k distributions and the draft's, with
   AdamW and a cosine schedule; checkpoints, and a periodic evaluation of the
   draft's acceptance rate through the real engine on held-out text.
"""

from __future__ import annotations

import functools
import itertools
import math
import pickle
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from specdec.atomic import atomic_write
from specdec.config import GenerationConfig
from specdec.drafters.distilled import (
    ReducedVocabBackend,
    build_draft,
    build_exit_draft,
    own_parameters,
    read_meta,
    save_draft,
)
from specdec.drafters.eagle import EagleDrafter, build_eagle, head_forward
from specdec.drafters.model import ModelDrafter
from specdec.engine import Generator
from specdec.errors import ConfigError
from specdec.models import LoadedModel
from specdec.training.native_data import read_manifest, read_sequences
from specdec.training.ngram import JSONL_TEXT_FIELDS, corpus_files, documents, jsonl_records, record_text
from specdec.training.on_policy import (
    chat_template_of,
    continue_prompts,
    corpus_prompts,
    general_prompts,
    mixed_prompts,
)

TEACHER_FILE = "teacher.pt"
CHECKPOINT_FILE = "checkpoint.pt"


@dataclass(frozen=True)
class DraftArch:
    """``layers=2,keep=16384,init=spread``: layer count, kept vocabulary, which target layers start it.

    ``exit=L,keep=N`` instead trains only an exit (a linear map and a norm) on the
    target's own first L layers: the self-speculative drafter with a trained exit.
    """

    layers: int = 2
    keep: int = 16384
    init: str = "spread"  # "spread": target layers evenly from first to last; "first": the first ones
    exit: int = 0  # > 0: an exit draft on the target's first `exit` layers
    # A feature-conditioned head (drafters/eagle.py): `layers` decoder layers on the target's hidden states.
    eagle: bool = False

    def __str__(self) -> str:
        """The spec :meth:`parse` reads back."""
        if self.exit:
            return f"exit={self.exit},keep={self.keep}"
        if self.eagle:
            return f"eagle,layers={self.layers},keep={self.keep}"
        return f"layers={self.layers},keep={self.keep},init={self.init}"

    @staticmethod
    def parse(spec: str) -> DraftArch:
        values: dict[str, object] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, value = part.partition("=")
            if key in ("layers", "keep", "exit") and value.isdigit():
                values[key] = int(value)
            elif key == "init" and value in ("spread", "first"):
                values[key] = value
            elif part == "eagle":
                values["eagle"] = True
            else:
                raise ConfigError(
                    f"bad --arch part '{part}': use layers=N, keep=N, init=spread|first, exit=L or eagle "
                    "(e.g. layers=2,keep=16384 or eagle,layers=1,keep=8192)"
                )
        if values.get("eagle"):
            if values.get("exit") or "init" in values:
                raise ConfigError("an eagle head takes layers=N and keep=N only (not exit or init)")
            values.setdefault("layers", 1)
        return DraftArch(**values)  # type: ignore[arg-type]

    def layer_ids(self, target_layers: int) -> list[int]:
        if not 1 <= self.layers < target_layers:
            raise ConfigError(
                f"a draft needs 1 <= layers < {target_layers} (the target's layer count), got {self.layers}"
            )
        if self.init == "first" or self.layers == 1:
            return list(range(self.layers))
        return [round(i * (target_layers - 1) / (self.layers - 1)) for i in range(self.layers)]


@dataclass(frozen=True)
class DistillConfig:
    data: tuple[str, ...]
    out: str
    arch: DraftArch = field(default_factory=DraftArch)
    steps: int = 400
    batch: int = 8  # chunks per step
    seq_len: int = 128
    lr: float = 1e-3
    teacher_tokens: int = 400_000  # tokens of data the target scores
    on_policy_tokens: int = 0  # of those, how many the target writes itself (continuing prompts drawn from the data)
    general_prompts: float = 0.0  # of the prompts it continues, the share drawn from general topics instead of the data
    continue_tokens: int = 128  # the longest continuation the target writes per prompt
    generate_batch: int = 16  # prompts the target continues at once
    top_k: int = 32  # teacher entries kept per position
    eval_every: int = 100
    checkpoint_every: int = 50
    seed: int = 0
    # A draft folder of the same arch to start the draft's own weights from (its kept vocabulary may differ).
    init_from: str | None = None
    # A `specdec distill-data` folder: the target's own writing and hidden states, scored from those states (no
    # target forward), instead of ``data``.
    teacher_data: str | None = None
    # An eagle head's training-time test: it drafts this many tokens in training, from the second on its own features.
    unroll: int = 1

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "batch",
            "seq_len",
            "teacher_tokens",
            "top_k",
            "eval_every",
            "checkpoint_every",
            "continue_tokens",
            "generate_batch",
            "unroll",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.general_prompts <= 1.0:
            raise ConfigError(
                f"general_prompts is a share of the on-policy prompts, between 0 and 1, got {self.general_prompts}"
            )
        if self.general_prompts and not self.on_policy_tokens:
            raise ConfigError("general_prompts share the on-policy prompts: pass --on-policy-tokens N (> 0) with it")
        if not 0 <= self.on_policy_tokens <= self.teacher_tokens:
            raise ConfigError(
                f"on_policy_tokens must be between 0 and teacher_tokens ({self.teacher_tokens}), "
                f"got {self.on_policy_tokens}"
            )
        if self.unroll > 1 and not self.arch.eagle:
            raise ConfigError("--unroll trains an eagle head drafting on its own features: use it with --arch eagle")
        if self.unroll >= self.seq_len:
            raise ConfigError(f"--unroll {self.unroll} needs a longer --seq-len than {self.seq_len}: lower --unroll")
        if bool(self.data) == bool(self.teacher_data):
            raise ConfigError(
                "training data comes from --data (text files, folders or JSONL prompt files) or from --teacher-data "
                "(a specdec distill-data folder): pass one of them"
            )


@dataclass
class TeacherData:
    tokens: torch.Tensor  # [chunks, seq_len] int64, target token ids
    top_ids: torch.Tensor  # [chunks, seq_len, top_k] int32, indices into keep_ids, for the NEXT token
    top_logp: torch.Tensor  # [chunks, seq_len, top_k] float16
    keep_ids: torch.Tensor  # [N] int64
    held_out: int  # the last chunks, never trained on
    # [chunks, seq_len, H] bfloat16: the target's final hidden states (eagle heads read them).
    hidden: torch.Tensor | None = None


Progress = Callable[[str, float, float, dict], None]  # phase, done, total, figures


def collect_tokens(target: LoadedModel, config: DistillConfig, progress: Progress) -> list[int]:
    """``config.teacher_tokens`` target tokens: corpus text as it is, then the target's own continuations.

    Corpus text is read from the files in a seeded random order. The
    continuations (on-policy) are of prompt-only JSONL records among the
    data, then of prompts drawn from the corpus, until ``on_policy_tokens`` of
    them are written; they come last, so the held-out chunks are on-policy.
    """
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise ConfigError(f"target '{target.name}' has no tokenizer to read the training text with")
    eos = [tokenizer.eos_token_id or 0]
    corpus_limit = config.teacher_tokens - config.on_policy_tokens
    stream: list[int] = []
    prompts: list[str] = []
    files = corpus_files(list(config.data))
    random.Random(config.seed).shuffle(files)  # a sample of the whole corpus, not its first folder
    for path in files:
        if len(stream) >= corpus_limit and path.suffix != ".jsonl":
            continue
        for text in _texts(path):
            if isinstance(text, tuple):
                prompts.append(text[0])
            elif len(stream) < corpus_limit:
                stream += tokenizer(text, add_special_tokens=False)["input_ids"] + eos
                progress("reading data", min(len(stream), corpus_limit), corpus_limit, {})
    stream = stream[:corpus_limit]
    wanted = config.teacher_tokens - len(stream)
    if config.on_policy_tokens or prompts:
        drawn = iter(())
        if config.on_policy_tokens:
            general = general_prompts(config.seed)
            corpus = (
                corpus_prompts(list(config.data), config.seed, chat_template_of(target))
                if config.general_prompts < 1
                else general
            )
            drawn = mixed_prompts(corpus, general, config.general_prompts, config.seed)
        written, started = 0, time.perf_counter()
        for ids, new in continue_prompts(
            target, itertools.chain(prompts, drawn), config.continue_tokens, config.generate_batch
        ):
            stream += ids[1:] + eos if ids[:1] == [tokenizer.bos_token_id] else ids + eos
            written += new
            rate = written / max(time.perf_counter() - started, 1e-9)
            progress(
                "target writing on-policy data", min(len(stream) - corpus_limit, wanted), wanted, {"tokens_per_s": rate}
            )
            if len(stream) >= config.teacher_tokens:
                break
    return stream[: config.teacher_tokens]


def _texts(path: Path) -> Iterator[str | tuple[str]]:
    """Documents of one file; a JSONL record with only a prompt comes back as a 1-tuple (to be continued)."""
    if path.suffix != ".jsonl":
        yield from (text for text, _ in documents(path))
        return
    for record, _ in jsonl_records(path):
        if "prompt" in record and not set(record) & set(JSONL_TEXT_FIELDS[1:]):
            yield (str(record["prompt"]),)
        elif text := record_text(record):
            yield text


@torch.inference_mode()
def score_with_teacher(
    target: LoadedModel, stream: list[int], config: DistillConfig, progress: Progress
) -> TeacherData:
    """Cut ``stream`` into chunks and keep the target's top-k next-token distribution over the kept vocabulary."""
    chunks = len(stream) // (config.seq_len + 1)
    if chunks < 4:
        raise ConfigError(
            f"only {len(stream)} tokens of data: need at least {4 * (config.seq_len + 1)} "
            f"for --seq-len {config.seq_len}"
        )
    keep_ids = _kept(Counter(stream), min(config.arch.keep, target.vocab_size), target.vocab_size)
    data = torch.tensor(stream[: chunks * (config.seq_len + 1)]).view(chunks, config.seq_len + 1)
    tokens = data[:, :-1].contiguous()
    head = target.model.get_output_embeddings().weight[keep_ids]
    top_k = min(config.top_k, len(keep_ids))
    top_ids = torch.empty(chunks, config.seq_len, top_k, dtype=torch.int32)
    top_logp = torch.empty(chunks, config.seq_len, top_k, dtype=torch.float16)
    # An eagle head reads the target's hidden states: kept from this pass (2 bytes per value) rather than recomputed at
    # every training step, where the target's forward would cost several times the head's.
    states = (
        torch.empty(chunks, config.seq_len, target.model.config.get_text_config().hidden_size, dtype=torch.bfloat16)
        if config.arch.eagle
        else None
    )
    for start in range(0, chunks, config.batch):
        ids = tokens[start : start + config.batch]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = target.model.model(input_ids=ids).last_hidden_state
            logits = hidden @ head.T
        top_ids[start : start + len(ids)], top_logp[start : start + len(ids)] = _top(logits, top_k)
        if states is not None:
            states[start : start + len(ids)] = hidden.to(torch.bfloat16)
        progress("scoring with the target", start + len(ids), chunks, {})
    return TeacherData(tokens, top_ids, top_logp, keep_ids, held_out=max(1, chunks // 20), hidden=states)


def _top(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's entries of ``logits`` over the kept vocabulary: the ``top_k`` indices (int32) and their
    log-probabilities (float16)."""
    values, indices = torch.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    return indices.int(), values.half()


def _kept(counts: Counter, keep: int, vocab_size: int) -> torch.Tensor:
    """The ``keep`` most frequent token ids (ascending); a small corpus fills the rest with the lowest ids not seen."""
    keep_ids = torch.tensor(sorted(t for t, _ in counts.most_common(keep)), dtype=torch.long)
    if len(keep_ids) < keep:
        rest = torch.tensor([t for t in range(vocab_size) if t not in counts][: keep - len(keep_ids)], dtype=torch.long)
        keep_ids = torch.sort(torch.cat([keep_ids, rest])).values
    return keep_ids


@torch.inference_mode()
def teacher_from_data(target: LoadedModel, config: DistillConfig, progress: Progress) -> TeacherData:
    """Teacher data from a `specdec distill-data` folder: windows of ``seq_len`` positions within each sequence (from
    its start, the last one ending at its last recorded state, so each sequence's end is kept), the next token's top-k
    from the recorded states and the target's output rows; the windows of the last twentieth of the sequences held
    out whole."""
    manifest = read_manifest(Path(config.teacher_data))
    if manifest is not None and manifest["target"] != target.name:
        raise ConfigError(
            f"'{config.teacher_data}' was written by '{manifest['target']}', not '{target.name}': distill it with "
            f"--target {manifest['target']}, or write data with this target"
        )
    width = target.model.config.get_text_config().hidden_size
    length = config.seq_len
    windows: list[tuple[torch.Tensor, torch.Tensor]] = []
    per_sequence: list[int] = []
    counts: Counter = Counter()
    for written in read_sequences(config.teacher_data):
        if written.features.shape[1] != width:
            raise ConfigError(
                f"'{config.teacher_data}' holds states {written.features.shape[1]} wide, not this target's {width}: "
                "write the data with this target"
            )
        last = len(written.features) - length
        starts = sorted({*range(0, last + 1, length), last}) if last >= 0 else []
        for start in starts:
            windows.append((written.tokens[start : start + length], written.features[start : start + length]))
            counts.update(windows[-1][0].tolist())
        per_sequence.append(len(starts))
    if len(windows) < 4:
        raise ConfigError(
            f"'{config.teacher_data}' holds {len(windows)} windows of --seq-len {length}: need at least 4 (write more "
            "with specdec distill-data, or lower --seq-len)"
        )
    keep_ids = _kept(counts, min(config.arch.keep, target.vocab_size), target.vocab_size)
    head = target.model.get_output_embeddings().weight[keep_ids].float()
    top_k = min(config.top_k, len(keep_ids))
    tokens = torch.stack([t for t, _ in windows])
    states = torch.stack([f for _, f in windows])
    top_ids = torch.empty(len(windows), length, top_k, dtype=torch.int32)
    top_logp = torch.empty(len(windows), length, top_k, dtype=torch.float16)
    for start in range(0, len(windows), config.batch):
        logits = states[start : start + config.batch].float() @ head.T
        top_ids[start : start + len(logits)], top_logp[start : start + len(logits)] = _top(logits, top_k)
        progress("scoring the recorded states", start + len(logits), len(windows), {})
    held_out = min(len(windows) - 1, max(1, sum(per_sequence[-max(1, len(per_sequence) // 20) :])))
    hidden = states if config.arch.eagle else None
    return TeacherData(tokens, top_ids, top_logp, keep_ids, held_out=held_out, hidden=hidden)


def distill(
    target: LoadedModel, config: DistillConfig, resume: bool = False, progress: Progress = lambda *a: None
) -> dict:
    """Build or continue a draft in ``config.out``; returns the training record saved with it."""
    out = Path(config.out)
    teacher_path, checkpoint_path = out / TEACHER_FILE, out / CHECKPOINT_FILE
    if resume and not checkpoint_path.exists():
        raise ConfigError(f"nothing to resume in '{out}': no {CHECKPOINT_FILE} (run without --resume to start)")
    if not resume and checkpoint_path.exists():
        raise ConfigError(
            f"'{out}' already holds a distillation: pass --resume to continue it, or choose another --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    teacher_s = None
    if teacher_path.exists():
        teacher = _read_teacher(teacher_path)
    else:
        started = time.perf_counter()
        if config.teacher_data:
            teacher = teacher_from_data(target, config, progress)
        else:
            stream = collect_tokens(target, config, progress)
            teacher = score_with_teacher(target, stream, config, progress)
        atomic_write(teacher_path, lambda out: torch.save(asdict(teacher), out))
        teacher_s = time.perf_counter() - started
    model = target.model
    if config.arch.eagle != (teacher.hidden is not None):
        raise ConfigError(
            f"'{out}' holds teacher data for another kind of draft: choose another --out for --arch {config.arch}"
        )
    if config.arch.eagle:
        draft = build_eagle(model, teacher.keep_ids, config.arch.layers)
    elif config.arch.exit:
        draft = build_exit_draft(model, config.arch.exit, teacher.keep_ids)
    else:
        draft = build_draft(model, config.arch.layer_ids(len(model.model.layers)), teacher.keep_ids)
    if config.init_from and not resume:
        start_from(draft, config.init_from, target.name)
    params = list(own_parameters(draft).values())
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    record: dict = {
        "target": target.name,
        "arch": asdict(config.arch),
        "config": asdict(config),
        "evaluations": [],
        "train_s": 0.0,
    }
    step = 0
    if resume:
        try:
            state = torch.load(checkpoint_path)
            draft.load_state_dict(state["draft"], strict=False)
            optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"])
            step, record = int(state["step"]), state["record"] | {"config": asdict(config)}
        except _UNREADABLE as exc:
            raise ConfigError(
                f"'{checkpoint_path}' cannot be resumed from ({type(exc).__name__}: damaged, or of another --arch): "
                f"delete it and run without --resume to start over (the teacher data in {TEACHER_FILE} is kept)"
            ) from None
    else:
        record["teacher_s"] = teacher_s
    train_chunks = len(teacher.tokens) - teacher.held_out
    record["teacher_tokens"] = int(teacher.tokens.numel())
    if step == 0:
        record["evaluations"].append(evaluate(target, draft, teacher, step))
    draft.train()
    started = time.perf_counter()
    loss_value = float("nan")
    while step < config.steps:
        lr = config.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / config.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        rows = torch.randint(0, train_chunks, (config.batch,))
        if config.unroll > 1:
            loss = unrolled_eagle_loss(target, draft, teacher, rows, EAGLE_FEATURE_NOISE, config.unroll)[0]
        else:
            loss = batch_loss(target, draft, teacher, rows, noise=EAGLE_FEATURE_NOISE)[0]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        loss_value = float(loss.detach())
        elapsed = record["train_s"] + time.perf_counter() - started
        progress(
            "training",
            step,
            config.steps,
            {"loss": loss_value, "tokens_per_s": step * config.batch * config.seq_len / max(elapsed, 1e-9)},
        )
        if step % config.eval_every == 0 or step == config.steps:
            draft.eval()
            record["evaluations"].append(evaluate(target, draft, teacher, step) | {"loss": loss_value})
            draft.train()
        if step % config.checkpoint_every == 0 or step == config.steps:
            record["train_s"] += time.perf_counter() - started
            started = time.perf_counter()
            state = {
                "draft": own_parameters(draft),
                "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state(),
                "step": step,
                "record": record,
            }
            atomic_write(checkpoint_path, functools.partial(torch.save, state))  # a kill mid-save keeps the last one
    draft.eval()
    record |= {"steps": step, "tokens_trained": step * config.batch * config.seq_len, "final_loss": loss_value}
    if not config.arch.eagle:  # an eagle head stops by its tree's scores instead (drafters/eagle.py)
        record |= calibrate(draft, teacher)
    save_draft(draft, out, record)
    return record


# What reading a damaged or foreign torch file raises: a torn zip or pickle, missing keys, tensors of other shapes.
_UNREADABLE = (RuntimeError, EOFError, OSError, ValueError, KeyError, TypeError, AttributeError, pickle.UnpicklingError)


def _read_teacher(path: Path) -> TeacherData:
    """The teacher data saved in ``path``; a damaged file is a ConfigError (one line) that says to score again."""
    try:
        return TeacherData(**torch.load(path))
    except _UNREADABLE as exc:
        raise ConfigError(
            f"'{path}' cannot be read ({type(exc).__name__}: damaged): delete it, and the checkpoint beside it if any, "
            "to score the data again"
        ) from None


def start_from(draft, folder: str, target: str) -> None:
    """Copy the own weights of the draft saved in ``folder`` into ``draft``
    (same arch and target; output rows are the target's own)."""
    path = Path(folder) / "model.safetensors"
    if not path.is_file():
        raise ConfigError(
            f"--init-from '{folder}' holds no draft (no model.safetensors): pass a folder written by `specdec distill`"
        )
    if (distilled_for := read_meta(folder).get("target")) != target:
        raise ConfigError(
            f"--init-from '{folder}' was distilled for '{distilled_for}', not '{target}': "
            "start from a draft of this target"
        )
    saved = load_file(str(path))
    own = own_parameters(draft)
    mismatched = [name for name, p in own.items() if name not in saved or saved[name].shape != p.shape]
    if mismatched:
        raise ConfigError(
            f"--init-from '{folder}' is a draft of another shape ({mismatched[0]} differs): "
            "start from a draft distilled for this target with the same --arch layers"
        )
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(saved[name].to(p.dtype))


# Relative noise on the input features in training: drafting beyond one token reads the head's own, imperfect ones.
EAGLE_FEATURE_NOISE = 0.2
EAGLE_FEATURE_WEIGHT = 0.5  # of the feature regression against the cross-entropy
EVAL_DEPTH = 3  # drafted tokens an eagle head's held-out agreement is reported for


def batch_loss(
    target: LoadedModel, draft, teacher: TeacherData, rows: torch.Tensor, noise: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, top-1 agreement with the target) of the draft on teacher chunks ``rows``.

    A token draft predicts each next token from the tokens so far. An eagle head reads pairs (f_t, x_{t+1}) and predicts
    x_{t+2} (cross-entropy against the target's distribution) and f_{t+1} (a smooth-L1 regression, as EAGLE does, so
    that its output can stand in for the target's feature when it drafts further).
    """
    tokens, top_ids, top_logp = teacher.tokens[rows], teacher.top_ids[rows], teacher.top_logp[rows]
    if teacher.hidden is None:
        logits = draft(input_ids=tokens).logits
        return soft_cross_entropy(logits, top_ids, top_logp), (
            logits.argmax(-1) == top_ids[..., 0].long()
        ).float().mean()
    loss, _, agreement = unrolled_eagle_loss(target, draft, teacher, rows, noise, 1)
    return loss, agreement[0]


def unrolled_eagle_loss(
    target: LoadedModel, head, teacher: TeacherData, rows: torch.Tensor, noise: float, depth: int
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(loss, then each depth's loss and top-1 agreement) of an eagle head drafting ``depth`` tokens on teacher chunks
    ``rows`` (:func:`unrolled_eagle`). A depth's loss is the cross-entropy against the target's distribution plus the
    regression of the next state; the total weighs depth d by 0.8^(d - 1)."""
    top_ids, top_logp = teacher.top_ids[rows], teacher.top_logp[rows]
    states = teacher.hidden[rows].float()
    scale = states.pow(2).mean().sqrt()
    features = states[:, :-1] + noise * scale * torch.randn_like(states[:, :-1]) if noise else states[:, :-1]
    losses, agreement = [], []
    for d, (logits, predicted) in enumerate(unrolled_eagle(target, head, teacher.tokens[rows], features, depth), 1):
        regression = torch.nn.functional.smooth_l1_loss(
            predicted.float() / scale, states[:, d : d + logits.shape[1]] / scale
        )
        losses.append(soft_cross_entropy(logits, top_ids[:, d:], top_logp[:, d:]) + EAGLE_FEATURE_WEIGHT * regression)
        agreement.append((logits.argmax(-1) == top_ids[:, d:, 0].long()).float().mean())
    return sum(0.8**d * loss for d, loss in enumerate(losses)), losses, agreement


def unrolled_eagle(
    target: LoadedModel, head, tokens: torch.Tensor, features: torch.Tensor, depth: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An eagle head's logits and output features at each depth 1..``depth`` over chunks ``tokens`` [B, L] whose
    target states at positions 0..L-2 are ``features`` [B, L - 1, H].

    Depth 1 reads the target's states (f_p, x_{p+1}) at every position p, as when the head
    drafts the first token after a verified context; depth d >= 2 (the training-time test) reads the head's own feature
    from depth d - 1 with the true next token, at position p + d - 1, as when it drafts further, and attends to what
    its cache would hold then: the target-fed entries of positions up to p and its own chain's entries at p.
    """
    embed = target.model.get_input_embeddings()
    n = tokens.shape[1] - 1
    cache = DynamicCache() if depth > 1 else None
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    widths: list[int] = []
    for d in range(1, min(depth, n) + 1):
        width = n - d + 1  # queries p = 0 .. width - 1
        positions = torch.arange(d - 1, d - 1 + width)[None].expand(len(tokens), -1)
        mask = None if d == 1 else _unrolled_mask(n, widths, width, head.dtype)
        logits, predicted = head_forward(head, embed, tokens[:, d:], features[:, :width], positions, cache, mask)
        out.append((logits, predicted))
        features, widths = predicted[:, : width - 1], widths + [width]
    return out


def _unrolled_mask(n: int, widths: list[int], width: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [1, 1, width, cached + width] of a depth whose query p sees the first depth's entries 0..p,
    then entry p of each later depth held (its own chain), and itself."""
    query = torch.arange(width)[:, None]
    blocks = [torch.arange(n)[None] <= query]  # the first depth's entries: the target-fed context
    blocks += [torch.arange(w)[None] == query for w in widths[1:]]
    blocks.append(torch.arange(width)[None] == query)
    visible = torch.cat(blocks, dim=1)
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)[None, None]


def soft_cross_entropy(logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the draft against the teacher's renormalised top-k distribution (KL up to a constant)."""
    teacher = torch.softmax(top_logp.float(), dim=-1)
    draft_logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, top_ids.long())
    return -(teacher * draft_logp).sum(-1).mean()


@torch.inference_mode()
def calibrate(draft, teacher: TeacherData, min_precision: float = 0.4, buckets: int = 10) -> dict:
    """The draft's confidence floor: the lowest confidence from which its held-out top-1 guesses agree with the target
    at least ``min_precision`` of the time.

    A draft token costs a draft step and pays only when accepted; below this
    floor the drafter stops instead. ``min_precision`` leaves a margin over the
    break-even point of a draft a few times cheaper than its target.
    """
    held, top_ids = teacher.tokens[-teacher.held_out :], teacher.top_ids[-teacher.held_out :, :, 0].long()
    confidence, agree = [], []
    for rows in torch.arange(len(held)).split(8):
        probs = torch.softmax(draft(input_ids=held[rows]).logits.float(), dim=-1)
        top = probs.max(dim=-1)
        confidence.append(top.values.flatten())
        agree.append((top.indices == top_ids[rows]).flatten().float())
    conf, hit = torch.cat(confidence), torch.cat(agree)
    bucket = (conf * buckets).long().clamp(max=buckets - 1)
    table = [
        {
            "confidence": f"{b / buckets:.1f}-{(b + 1) / buckets:.1f}",
            "share": float((bucket == b).float().mean()),
            "agreement": float(hit[bucket == b].mean()),
        }
        for b in range(buckets)
        if bool((bucket == b).any())
    ]
    floor = 1.0
    for b in reversed(range(buckets)):  # walk down while every bucket above still agrees often enough
        inside = bucket == b
        if bool(inside.any()) and float(hit[inside].mean()) < min_precision:
            break
        floor = b / buckets
    return {"min_confidence": floor, "calibration": table}


@torch.inference_mode()
def evaluate(
    target: LoadedModel,
    draft,
    teacher: TeacherData,
    step: int,
    prompts: int = 4,
    prompt_len: int = 32,
    new_tokens: int = 24,
) -> dict:
    """Held-out figures: loss, the draft's top-1 agreement with the teacher, its acceptance rate in the engine
    (greedy, k = 4)."""
    chunks = len(teacher.tokens)
    losses, agreements = [], []
    # Bounded memory: logits are [rows, seq_len, kept vocabulary].
    for rows in torch.arange(chunks - teacher.held_out, chunks).split(8):
        if teacher.hidden is None:
            loss, agree = batch_loss(target, draft, teacher, rows)
            losses.append(loss)
            agreements.append([agree])
        else:  # an eagle head drafting 1, 2, 3 tokens deep, on its own features beyond the first
            _, depth_losses, agree_by_depth = unrolled_eagle_loss(target, draft, teacher, rows, 0.0, EVAL_DEPTH)
            losses.append(depth_losses[0])
            agreements.append(agree_by_depth)
    loss = torch.stack(losses).mean()
    by_depth = [float(torch.stack(d).mean()) for d in zip(*agreements, strict=True)]
    agree = by_depth[0]
    held = teacher.tokens[-teacher.held_out :]
    if teacher.hidden is not None:
        drafter = EagleDrafter(draft, target.model.get_input_embeddings(), target.vocab_size)
    else:
        drafter = ModelDrafter(ReducedVocabBackend(draft, target.vocab_size))
    generator = Generator(target, drafter, GenerationConfig(k=4, k_policy="fixed", max_new_tokens=new_tokens))
    proposed = accepted = 0
    for row in held[:prompts]:
        stats = generator.generate(row[:prompt_len].tolist(), stop_on_eos=False).stats
        proposed += stats.draft_tokens_proposed
        accepted += stats.draft_tokens_accepted
    return {
        "step": step,
        "held_out_loss": float(loss),
        "top1_agreement": float(agree),
        "acceptance_rate": accepted / max(proposed, 1),
    } | ({"agreement_by_depth": by_depth} if teacher.hidden is not None else {})
