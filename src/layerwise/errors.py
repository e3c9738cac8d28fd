"""One error family: every error layerwise raises on purpose is a :class:`LayerwiseError`.

==========================  ==================================================================================
error                       raised when
==========================  ==================================================================================
``LayerwiseError``          the base (a ``ValueError``): the input, an option or a file is wrong; the message
                            names the value and says how to fix it. The CLI exits with status 2 on any of them
``SpecError``               an :class:`~layerwise.EncodeSpec` or a layer spec is malformed or does not fit the
                            model (an out-of-range layer, an unknown mode, an option that does not apply)
``ModelLoadError``          a model cannot be found or loaded (missing path, offline hub id, pickle without
                            ``allow_pickle``, bad :class:`~layerwise.ModelOptions`)
``MappingError``            a model's layers cannot be found or verified (a ``ModelLoadError``)
``MissingExtraError``       an optional extra is not installed; the message holds the ``pip install`` line
``InputError``              an input cannot be read as asked (format, columns, a table of the wrong kind)
``StoreError``              a store cannot be opened or written (not a store, made with other options)
``StoreFullError``          the disk filled up while writing; the same command resumes once space is freed
``StoreCorruptError``       a store's files are damaged (a missing or truncated shard, a bad manifest)
``ExtractError``            an extraction cannot start or must stop (bad options, a bad record under ``strict``)
``ExportError``             a model export cannot be written (the output is taken, the disk is full) or the
                            written directory failed its check against layerwise (the numbers are in the message)
``ServiceError``            the layerwise service answered a request with an error (status and detail)
==========================  ==================================================================================

Wrapping keeps the cause: ``raise ExtractError(...) from exc``, so ``__cause__`` says what went wrong below.

Example::

    >>> import layerwise as lw
    >>> issubclass(lw.StoreFullError, lw.LayerwiseError), issubclass(lw.LayerwiseError, ValueError)
    (True, True)
"""

from __future__ import annotations


class LayerwiseError(ValueError):
    """The base of every error layerwise raises on purpose (a ``ValueError``: the input or an option is wrong)."""


class SpecError(LayerwiseError):
    """An :class:`~layerwise.EncodeSpec`, a layer spec or a mode is malformed or does not fit the model.

    Attributes:
        flag_message: the same message in the command line's words (``--layers 0,3`` where the message says
            ``layers=[0, 3]``), where the two differ; ``None`` otherwise. The CLI prints it instead of the message.
    """

    def __init__(self, message: str, *, flag_message: str | None = None):
        super().__init__(message)
        self.flag_message = flag_message


class ModelLoadError(LayerwiseError):
    """A model could not be found or loaded; the message says what to do instead."""


class MappingError(ModelLoadError):
    """The layers of a model could not be found or verified; the message lists what was tried."""


class MissingExtraError(LayerwiseError):
    """An optional extra is not installed.

    Attributes:
        extra: the extra's name (``"tf"``, ``"ray"``, ``"hf"``...).
    """

    def __init__(self, what: str, extra: str, packages: str = ""):
        self.extra = extra
        line = f"pip install 'layerwise[{extra}]'"
        super().__init__(f"{what} needs the optional extra [{extra}]{f' ({packages})' if packages else ''}: {line}")


class InputError(LayerwiseError):
    """An input cannot be read as asked: an unknown format, a missing column, a file that is not what its suffix
    says, a table of the wrong kind; the message names the input and what it holds instead."""


class StoreError(LayerwiseError):
    """A store that cannot be opened or written (not a store, made with other options, disk full...)."""


class StoreFullError(StoreError):
    """The disk filled up while writing; what was finished is safe and the same command resumes."""


class StoreCorruptError(StoreError):
    """A store's files are damaged: a shard missing, cut short, changed or swapped, or a damaged manifest.

    Attributes:
        file: the damaged file's path (``None`` when the message names several).
        problem: what is wrong with it, without the file's name or the fix.
    """

    def __init__(self, message: str, *, file: str | None = None, problem: str | None = None):
        super().__init__(message)
        self.file = file
        self.problem = problem or message


class ExtractError(LayerwiseError):
    """A run that cannot start or must stop: bad options, a store mismatch, a full disk, a bad record (strict)."""


class ExportError(LayerwiseError):
    """A model export cannot be written, or the written directory does not match layerwise on the probe set."""


class ServiceError(LayerwiseError):
    """The layerwise service answered (or, inside the service, answers) with an error.

    Attributes:
        status: the HTTP status code (0 when the service could not be reached).
        detail: the service's explanation.
        param, code: the request field at fault and a machine-readable code, where known.
    """

    def __init__(self, status: int, detail: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        self.status = status
        self.detail = detail
        self.param, self.code = param, code  # the request field at fault, a machine-readable code (OpenAI's)
        self.headers = dict(headers or {})  # response headers the service sends with it (Retry-After)
        super().__init__(f"HTTP {status}: {detail}")


__all__ = ["ExportError", "ExtractError", "InputError", "LayerwiseError", "MappingError", "MissingExtraError",
           "ModelLoadError", "ServiceError",
           "SpecError", "StoreCorruptError", "StoreError", "StoreFullError"]
