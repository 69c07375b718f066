"""specdec's own CPU runtime: packed int8/int4 weights, a paged KV cache, and kernels compiled for this CPU.

- ``model``: the forward pass of Gemma-3, Llama, Mistral and Qwen2/3 models, and the backends the engine drives;
- ``store``: reading checkpoints (safetensors, GGUF) and the converted models cached on disk;
- ``formats``: the packed weight formats, their product with activations (``linear``) and the measured choice of one;
- ``paged_cache`` and ``ops``: the KV cache, attention over it, norms and activations;
- ``kernel_build``: compiling and loading the C++ kernels in ``kernels/`` for this CPU's instruction set.
"""

from specdec.models.native.model import (
    FIRST_CAPACITY,
    NativeBackend,
    NativeModel,
    NativeRows,
    new_cache,
    unsupported,
)

__all__ = ["FIRST_CAPACITY", "NativeBackend", "NativeModel", "NativeRows", "new_cache", "unsupported"]
