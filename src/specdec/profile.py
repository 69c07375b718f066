"""A tuned profile: the fastest exact configuration `specdec tune` measured for one target, machine and workload.

It is a small JSON (or TOML) file that `generate`, `bench`, `serve` and ``Generator.from_profile`` read. It
names the runtime (backend, precision), the drafter and the k settings, and records what it was tuned on, so
that a profile carried to another machine or used with another model warns instead of silently being slow.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.atomic import PUBLIC, atomic_write_bytes
from specdec.config import BatchConfig, GenerationConfig, PrecisionPlan, RuntimeConfig, SamplingConfig
from specdec.errors import ConfigError
from specdec.machine import fingerprint

VERSION = 1


class ProfileError(ConfigError):
    """A profile file cannot be read, or names something this installation cannot run."""


class ProfileWarning(UserWarning):
    """A profile is used with another target or on another machine than it was tuned for."""


@dataclass(frozen=True)
class Profile:
    """What to run (target, runtime, drafter, k settings) and what it was tuned on (machine, sampling, figures)."""

    target: str
    drafter: str  # a drafter spec (DRAFT_SPECS); trees are generation.branches > 1
    runtime: RuntimeConfig
    generation: GenerationConfig
    batch: BatchConfig = BatchConfig()
    machine: dict[str, str | int] = field(default_factory=fingerprint)
    # Tokens/s of this configuration and of target-only, when tuned.
    measured: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        g = self.generation
        return {
            "version": VERSION,
            "target": self.target,
            "drafter": self.drafter,
            "runtime": runtime_dict(self.runtime),
            "generation": {
                "k": g.k,
                "k_policy": g.k_policy,
                "branches": g.branches,
                "temperature": g.sampling.temperature,
            },
            "batch": asdict(self.batch),
            "machine": self.machine,
            "measured": self.measured,
        }

    def save(self, path: Path) -> None:
        """Write the profile as JSON (a TOML profile is read, never written: JSON needs no extra package), whole or not
        at all (a kill mid-save leaves the previous profile); readable by all (it holds settings, no user text)."""
        if path.suffix == ".toml":
            raise ProfileError(f"profiles are written as JSON: name the file {path.with_suffix('.json')}")
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, (json.dumps(self.to_dict(), indent=1) + "\n").encode(), PUBLIC)

    @staticmethod
    def load(path: str | Path) -> Profile:
        """Read a profile from `specdec tune` (JSON, or the same keys in TOML); errors name the file and the problem."""
        path = Path(path)
        if not path.is_file():
            raise ProfileError(
                f"profile '{path}' does not exist: write one with `specdec tune --out DIR` (it writes DIR/profile.json)"
            )
        try:
            text = path.read_text(encoding="utf-8")
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except OSError as exc:
            raise ProfileError(
                f"profile '{path}' cannot be read ({exc.strerror}): check the path and its permissions"
            ) from None
        except (UnicodeDecodeError, json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ProfileError(
                f"profile '{path}' is not valid {'TOML' if path.suffix == '.toml' else 'JSON'} ({exc}): "
                "rerun `specdec tune`"
            ) from None
        return Profile.from_dict(data, str(path))

    @staticmethod
    def from_dict(data: object, where: str = "profile") -> Profile:
        if not isinstance(data, dict) or data.get("version") != VERSION:
            version = data.get("version") if isinstance(data, dict) else None
            raise ProfileError(
                f"'{where}' is not a specdec profile of version {VERSION} (version: {version}): rerun `specdec tune`"
            )
        try:
            runtime = dict(data["runtime"])
            batch = dict(data.get("batch", {}))
            if "window" in batch:  # k_cap's former name, in profiles written before it
                batch.setdefault("k_cap", batch.pop("window"))
            plan = runtime.pop("precision", None)
            gen = data["generation"]
            generation = GenerationConfig(
                k=gen["k"],
                k_policy=gen["k_policy"],
                branches=gen.get("branches", 1),
                sampling=SamplingConfig(gen.get("temperature", 0.0)),
            )
            return Profile(
                target=str(data["target"]),
                drafter=str(data["drafter"]),
                runtime=RuntimeConfig(**runtime, precision=PrecisionPlan.parse(plan) if plan else None),
                generation=generation,
                batch=BatchConfig(**batch),
                machine=dict(data.get("machine", {})),
                measured=dict(data.get("measured", {})),
            )
        except KeyError as exc:
            raise ProfileError(f"profile '{where}' lacks the key {exc}: rerun `specdec tune`") from None
        except ConfigError as exc:
            raise ProfileError(f"profile '{where}': {exc}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise ProfileError(f"profile '{where}' has a malformed section ({exc}): rerun `specdec tune`") from None

    def differences(self, target: str | None = None) -> list[str]:
        """Why this profile may not be the fastest here: another target or machine (one line each, with the fix)."""
        notes = []
        if target is not None and target != self.target:
            notes.append(
                f"the profile was tuned for target '{self.target}', not '{target}': "
                f"rerun `specdec tune --target {target}`"
            )
        here = fingerprint()
        changed = [
            f"{key} {self.machine[key]!r} -> {value!r}"
            for key, value in here.items()
            if key in self.machine and self.machine[key] != value
        ]
        if changed:
            notes.append(f"the profile was tuned on another machine ({'; '.join(changed)}): rerun `specdec tune` here")
        return notes

    def check_installed(self) -> None:
        """Refuse a profile whose backend or drafter is not available in this installation, with the fix."""
        from specdec.models.llamacpp import llama_cpp_problem

        kind, _, arg = self.drafter.partition(":")
        if (self.runtime.backend == "llama.cpp" or kind == "gguf") and (problem := llama_cpp_problem()):
            part = "backend" if self.runtime.backend == "llama.cpp" else f"drafter '{self.drafter}'"
            raise ProfileError(
                f"the profile's {part} runs on llama.cpp, which cannot run here: {problem}; or rerun `specdec tune`"
            )
        local = kind == "ngram" or arg.startswith(("/", ".", "~"))  # model:/gguf: may also name a hub id or an alias
        if arg and local and not Path(arg).expanduser().exists():
            raise ProfileError(
                f"the profile's drafter '{self.drafter}' names '{arg}', which does not exist here: "
                "copy it, or rerun `specdec tune`"
            )


def runtime_dict(runtime: RuntimeConfig) -> dict[str, object]:
    """A runtime as a profile stores it (the precision plan by its description)."""
    return asdict(runtime) | {"precision": runtime.precision.describe() if runtime.precision else None}


def load_profile(path: str | Path) -> Profile:
    """A profile read from ``path`` and checked for this installation (its backend and drafter are there)."""
    profile = Profile.load(path)
    profile.check_installed()
    return profile
