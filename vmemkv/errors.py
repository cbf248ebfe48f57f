"""Exceptions of vmemkv. Each message says what was asked, what the limit is, and what to change."""


class VmemkvError(Exception):
    """Base class of every error vmemkv raises on purpose."""


class ConfigError(VmemkvError, ValueError):
    """A size, shape or option that cannot work (for example a page size that is not a multiple
    of the OS page or of the CUDA allocation granularity)."""


class UnsupportedModelError(ConfigError):
    """A model whose attention vmemkv cannot reproduce (an attention chunk shorter than the longest
    sequence, non-attention layers, ALiBi, ...): running it would silently give other tokens."""


class MappingError(VmemkvError):
    """A map or unmap request that is outside a reservation, or that the OS or driver refused."""


class MappingLimitError(MappingError):
    """Mapping would exceed the OS limit on separate mappings (``vm.max_map_count``)."""


class OutOfBlocksError(VmemkvError):
    """The block pool cannot supply the blocks asked for; nothing was changed."""


class InvalidStateError(VmemkvError):
    """An operation the current state does not allow; nothing was changed. Raised as one of the
    two kinds below."""


class RequestStateError(InvalidStateError):
    """A request operation its request's state does not allow: admitting a request twice,
    committing past what is reserved, forking one with uncomputed tokens, ..."""


class BlockStateError(InvalidStateError):
    """A block operation that breaks the pool's rules, such as releasing a free block."""


class RequestTooLongError(VmemkvError, ValueError):
    """A request needs more tokens than ``max_model_len`` allows."""


class NativeExtensionError(VmemkvError, ImportError):
    """The compiled CPU mapper (``vmemkv._native``) is not built; only the CPU backend needs it."""


class CudaDriverError(VmemkvError):
    """A CUDA driver call failed; the message carries the driver's own error string."""


class InvalidInputError(VmemkvError, ValueError):
    """An argument of the wrong type or out of range at the library boundary (a float token id,
    a negative size, a layer or slot that does not exist); refused before anything changed."""


class ManagerClosedError(VmemkvError):
    """A call on a manager after ``close()`` (its memory is gone; build a new manager), or
    ``close()`` while tensors viewing that memory are still held."""


class ModelUnavailableError(ConfigError):
    """A model that cannot be obtained here: not built in, not cached, and not downloadable (no
    registry access, or a Hugging Face Hub id missing from the local Hugging Face cache)."""
