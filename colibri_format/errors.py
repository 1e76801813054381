"""The one exception tree of Colibri. Library code raises these; command-line tools catch them at the edge.

Every message says what is wrong and, where it can, what to do about it.
"""

from __future__ import annotations


class ColibriError(Exception):
    """Base of every error Colibri raises on purpose."""


class FormatError(ColibriError):
    """A container, data file, index or sidecar is malformed, truncated, inconsistent or hostile."""


class VersionError(FormatError):
    """A file declares a format version this library does not read."""


class IntegrityError(FormatError):
    """A checksum does not match: the bytes on disk are not the bytes that were written."""


class WriterStateError(ColibriError):
    """A writer method was called out of order (for example a tensor added after finish())."""


class QuantizationError(ColibriError):
    """A tensor cannot be encoded as asked (wrong rank, non-finite values, unknown encoding)."""


class ConversionError(ColibriError):
    """A source checkpoint cannot be converted (unknown family, leftover or missing tensors, changed parameters)."""


class RuntimeModelError(ColibriError):
    """The runtime cannot run this container (unsupported family or configuration)."""


class SidecarError(FormatError):
    """A sidecar file (.coli_usage, .coli_kv, resume state) is unusable; callers usually warn and start fresh."""
