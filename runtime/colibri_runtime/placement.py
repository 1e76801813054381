"""Placement: from a RAM budget and the user's options to a tier cache, and the usage history that teaches it.

`--ram GB` is a budget for everything the runtime holds: resident (dense) weights, the expert cache, the attention
state and working buffers. What is left after the resident weights and the reserves goes to experts: first the
pinned hot set (`--pin`), then an equal LRU share per MoE layer. `.coli_usage` is read at start (a broken one is
ignored with a warning) and replaced after every turn.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri_format.errors import ColibriError, SidecarError
from colibri_format.usage import UsageCounts, default_usage_path

from .expert_io import RecordReader
from .tiers import CachePlan, TieredExpertProvider, hottest_experts, plan_cache

GIB = 1024**3
WORKING_RESERVE_BYTES = 256 * 1024**2
DEFAULT_RESERVE_FRACTION = 0.10
AUTO_PIN_SHARE = 0.5
# --pin auto pins only experts clearly hotter than their layer's average: with a flat history (a random router, a
# new container) pinning would only shrink the LRU.
AUTO_PIN_MIN_HEAT = 1.5


@dataclass(frozen=True)
class PlacementOptions:
    ram_gb: float | None = None  # None: available memory less a reserve
    pin: str = "auto"  # "auto", "0", a size in GB, or a .coli_usage file to learn from
    prefetch: bool = True
    io_threads: int = 4
    direct: str = "auto"  # on | off | auto
    mirrors: tuple[str, ...] = ()
    disk_weights: tuple[float, ...] = ()
    context_tokens: int = 4096
    verify_reads: bool = False


@dataclass(frozen=True)
class Budget:
    total: int
    resident: int
    kv: int
    working: int
    experts: int
    expert_bytes: int
    moe_layers: int
    num_experts: int

    @property
    def fits_all_experts(self) -> bool:
        return self.experts >= self.expert_bytes * self.moe_layers * self.num_experts


def available_memory_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil is a dependency
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return 8 * GIB


def resident_bytes(container) -> int:
    return sum(info["size"] for info in container.manifest["files"].values() if info["role"] == "resident")


def kv_bytes_per_token(config: dict) -> int:
    """float32 attention state per token over all layers (MLA keeps the compressed latent and the rope key)."""
    layers = int(config.get("num_hidden_layers", 1))
    if config.get("kv_lora_rank"):
        width = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim", 0))
        if config.get("index_head_dim"):
            width += int(config["index_head_dim"])
    else:
        heads = int(config.get("num_key_value_heads") or config.get("num_attention_heads", 1))
        head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // int(
            config.get("num_attention_heads", 1)))
        width = 2 * heads * head_dim
    return 4 * width * layers


def compute_budget(container, options: PlacementOptions) -> Budget:
    layers = container.expert_layers
    expert_bytes = max((container.record_location(layer, 0).length for layer in layers[:1]), default=0)
    total = int(options.ram_gb * GIB) if options.ram_gb else int(available_memory_bytes() * (1 - DEFAULT_RESERVE_FRACTION))
    resident = resident_bytes(container)
    context = min(options.context_tokens, int(container.config.get("max_position_embeddings", options.context_tokens)))
    kv = kv_bytes_per_token(container.config) * context
    # Read buffers in flight or waiting for reuse: one per reader thread plus a layer's worth of prefetches.
    top_k = int(container.config.get("num_experts_per_tok") or 8)
    working = WORKING_RESERVE_BYTES + spare_read_buffers(options, top_k) * expert_bytes
    experts = total - resident - kv - working
    if experts < 0:
        raise ColibriError(
            f"--ram {total / GIB:.2f} GiB cannot hold this model's resident weights ({resident / GIB:.2f} GiB), "
            f"attention state ({kv / GIB:.2f} GiB for {context} tokens) and working buffers ({working / GIB:.2f} GiB); "
            "give more --ram, or a smaller --context"
        )
    return Budget(total, resident, kv, working, experts, expert_bytes, len(layers), container.num_experts)


def spare_read_buffers(options: PlacementOptions, top_k: int) -> int:
    """Read buffers the tier cache may hold beyond its cached experts (in flight, or kept for reuse)."""
    return options.io_threads + 2 * top_k


def load_usage(container, path: Path | None = None) -> tuple[UsageCounts, Path]:
    """The container's usage history (zeros if there is none or it is unusable, with a warning)."""
    layers = container.expert_layers
    slots = max(int(container.config.get("num_hidden_layers", 0)), (max(layers) + 1) if layers else 0)
    dims = (slots, max(1, container.num_experts))
    target = Path(path) if path else default_usage_path(container.path, container.fingerprint)
    if target.exists():
        try:
            return UsageCounts.load(target, expect_fingerprint=container.fingerprint, expect_dims=dims), target
        except SidecarError as exc:
            warnings.warn(f"ignoring {target}: {exc}; starting a fresh usage history", stacklevel=2)
    return UsageCounts.empty(container.fingerprint, *dims), target


def save_usage(usage: UsageCounts, path: Path, turn_counts: np.ndarray) -> None:
    """Fold one turn into the history and replace the file atomically (never fatal: a read-only place warns)."""
    usage.add_turn(turn_counts)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        usage.save(path)
    except OSError as exc:
        warnings.warn(f"cannot write usage history {path}: {exc.strerror}", stacklevel=2)


def pin_bytes(option: str, budget: Budget) -> tuple[int, Path | None]:
    """Bytes to pin and, when the option names a file, the usage file to learn from."""
    if option == "auto":
        return int(budget.experts * AUTO_PIN_SHARE), None
    try:
        return max(0, int(float(option) * GIB)), None
    except ValueError:
        path = Path(option)
        if not path.is_file():
            raise ColibriError(f"--pin {option!r} is neither auto, a size in GB, nor a .coli_usage file") from None
        return int(budget.experts * AUTO_PIN_SHARE), path


def build_provider(container, options: PlacementOptions, trace=None):
    """The tier cache for this container under these options, plus the usage history and where to save it."""
    budget = compute_budget(container, options)
    pin, learn_from = pin_bytes(options.pin, budget)
    usage, usage_path = load_usage(container)
    learned = usage
    if learn_from is not None:
        learned, _ = load_usage(container, learn_from)
    min_heat = AUTO_PIN_MIN_HEAT if options.pin == "auto" or learn_from is not None else 0.0
    hot = hottest_experts(learned.counts, container.expert_layers, min_heat)
    plan = plan_cache(budget.experts, budget.expert_bytes, container.expert_layers, pin, hot)
    if budget.fits_all_experts:
        plan = CachePlan(container.num_experts, plan.pinned)
    container_bytes = budget.expert_bytes * budget.moe_layers * budget.num_experts
    direct = options.direct
    if direct == "auto":
        # Bypass the page cache only when it could not hold the experts anyway.
        direct = "on" if container_bytes > budget.experts else "off"
    reader = RecordReader(
        container,
        mirrors=[Path(m) for m in options.mirrors],
        direct=direct,
        drive_weights=list(options.disk_weights) or None,
        drop_page_cache=options.ram_gb is not None,
    )
    top_k = int(container.config.get("num_experts_per_tok") or 8)
    provider = TieredExpertProvider(container, plan, reader=reader, io_threads=options.io_threads,
                                    prefetch=options.prefetch, verify_reads=options.verify_reads, trace=trace,
                                    spare_buffers=spare_read_buffers(options, top_k))
    return provider, budget, usage, usage_path
