"""Constants that mirror specs/CONTAINER.md, specs/QUANT.md and specs/SIDECARS.md.

Every magic number of the format lives here and nowhere else. Retired values stay as comments so they are never
reused. A change here is a change of the spec: update the spec and the golden files in the same commit.
"""

from __future__ import annotations

# --- Container (specs/CONTAINER.md) -------------------------------------------------------------------------------
FORMAT_NAME = "colibri"
FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)

MANIFEST_NAME = "colibri.json"
EXPERT_INDEX_NAME = "experts.arrow"
RESIDENT_FILE_PATTERN = "resident-{:05d}.safetensors"
MTP_FILE_PATTERN = "mtp-{:05d}.safetensors"
EXPERT_FILE_PATTERN = "experts-{:05d}.colx"

# Files copied verbatim from the source checkpoint when present.
VERBATIM_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)

# Expert data files: a 4096-byte header, then records, each starting on a 4096-byte boundary.
EXPERT_FILE_MAGIC = b"COLIBRIX"
EXPERT_FILE_HEADER_SIZE = 4096
RECORD_ALIGNMENT = 4096
PART_ALIGNMENT = 64
EXPERT_PARTS = ("gate", "up", "down")

# Default target size of one data file (resident or experts) before a new shard is started.
DEFAULT_SHARD_BYTES = 4 * 1024**3

# Reader safety limits: anything beyond is refused as malformed, never allocated.
MAX_MANIFEST_BYTES = 64 * 1024**2
MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024**2
MAX_TENSOR_RANK = 8

# safetensors metadata key under which each tensor's Colibri encoding is recorded.
SAFETENSORS_ENCODINGS_KEY = "colibri.encodings"
SCALES_SUFFIX = ".scales"

# --- Quantization (specs/QUANT.md) --------------------------------------------------------------------------------
GROUP_SIZE = 64
INT4_BYTES_PER_GROUP = GROUP_SIZE // 2
INT4_ZERO_CODE = 8  # stored nibble = code + 8, code in [-8, 7]
INT4_CODE_MIN, INT4_CODE_MAX = -8, 7
INT4_SCALE_DIVISOR = -8.0  # scale = (signed value of largest magnitude) / -8
INT8_CODE_MAX = 127
INT8_SCALE_DIVISOR = 127.0


class Encoding:
    """Names of tensor encodings, as written in manifests, indexes and safetensors metadata."""

    INT4_GS64 = "int4_gs64"
    INT8_GS64 = "int8_gs64"
    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"

    ALL = (INT4_GS64, INT8_GS64, F32, F16, BF16)
    QUANTIZED = (INT4_GS64, INT8_GS64)


# Tensor classes a recipe assigns encodings to, and the defaults (specs/QUANT.md, "Default recipe").
TENSOR_CLASSES = (
    "routed_experts",
    "shared_experts",
    "dense_mlp",
    "attention",
    "embeddings",
    "lm_head",
    "mtp",
    "router",
    "norm",
    "bias",
)
DEFAULT_RECIPE = {
    "routed_experts": Encoding.INT4_GS64,
    "shared_experts": Encoding.INT4_GS64,
    "dense_mlp": Encoding.INT4_GS64,
    "attention": Encoding.INT4_GS64,
    "embeddings": Encoding.INT8_GS64,
    "lm_head": Encoding.INT8_GS64,
    "mtp": Encoding.INT8_GS64,
    "router": Encoding.F32,
    "norm": Encoding.F32,
    "bias": Encoding.F32,
}
# Classes that must never be quantized below their default (a recipe asking for it is refused).
UNQUANTIZABLE_CLASSES = ("router", "norm", "bias")

# --- Sidecars (specs/SIDECARS.md) ---------------------------------------------------------------------------------
USAGE_FILE_NAME = ".coli_usage"
USAGE_MAGIC = b"COLIUSE1"
USAGE_VERSION = 1
KV_FILE_SUFFIX = ".coli_kv"
KV_MAGIC = b"COLIKV01"
KV_VERSION = 1
