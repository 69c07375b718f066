"""User-facing errors.

Every problem a user can cause (a bad argument, a missing model, a prompt that
does not fit) raises a subclass of :class:`SpecDecError`, itself a
``ValueError``, with a one-line message naming the problem and the fix. The CLI
prints that line and exits with code 2 instead of a traceback.
"""


class SpecDecError(ValueError):
    """Base class of every error caused by user input."""


class ConfigError(SpecDecError):
    """A generation or engine setting is out of range."""


class ModelNotFoundError(SpecDecError):
    """A model name does not resolve to an alias, folder, GGUF file or hub id."""


class MissingPackageError(SpecDecError):
    """A model or feature needs a package that is not installed."""


class VocabularyMismatchError(SpecDecError):
    """Draft and target do not share a vocabulary."""


class PromptError(SpecDecError):
    """The prompt is empty, not valid text, or does not fit the model's context."""


class ContextLengthError(PromptError):
    """The prompt does not fit the model's context (in tokens, or bounded by its characters before tokenizing)."""


class DeploymentError(SpecDecError):
    """A Ray Serve deployment's replicas failed to start (the message says why, from the replica)."""
