"""colibri_format: the Colibri expert container format (specs/CONTAINER.md, specs/QUANT.md, specs/SIDECARS.md)."""

from .constants import FORMAT_VERSION, Encoding
from .errors import (
    ColibriError,
    FormatError,
    IntegrityError,
    QuantizationError,
    SidecarError,
    VersionError,
    WriterStateError,
)
from .quant import QuantizedTensor, dequantize, quantize, quantize_reference

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "ColibriError",
    "Encoding",
    "FormatError",
    "IntegrityError",
    "QuantizationError",
    "QuantizedTensor",
    "SidecarError",
    "VersionError",
    "WriterStateError",
    "dequantize",
    "quantize",
    "quantize_reference",
]
