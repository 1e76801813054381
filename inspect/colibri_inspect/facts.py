"""What the inspector knows about one container: sizes by role, expert geometry, dimensions, and its usage history.

`ContainerFacts.load` opens the container with the format library (which validates everything header-deep) and
boils it down to numbers. `load_usage` finds and reads the `.coli_usage` sidecar that belongs to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri_format.constants import USAGE_FILE_NAME
from colibri_format.errors import SidecarError
from colibri_format.reader import Container
from colibri_format.usage import UsageCounts, default_usage_path

from .dims import ModelDims

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclass(frozen=True)
class ContainerFacts:
    path: Path
    manifest: dict
    config: dict
    dims: ModelDims
    family: str
    fingerprint: str
    format_version: int
    bytes_by_role: dict[str, int]
    expert_layers: tuple[int, ...]
    num_experts: int
    records: int
    bytes_per_expert: int  # payload of one expert record: what one read loads and one cache slot holds
    padded_bytes_per_expert: int  # the same, rounded up to the record alignment (the bytes it occupies on disk)
    bytes_per_layer: dict[int, int]  # on-disk bytes of each layer's records
    records_per_file: dict[str, list[tuple[int, int]]]  # expert data file -> (layer, expert) it holds

    @classmethod
    def load(cls, path: Path | str) -> ContainerFacts:
        path = Path(path)
        with Container.open(path) as c:
            by_role: dict[str, int] = {}
            for info in c.manifest["files"].values():
                by_role[info["role"]] = by_role.get(info["role"], 0) + int(info["size"])
            per_layer: dict[int, int] = {}
            per_file: dict[str, list[tuple[int, int]]] = {}
            lengths = []
            padded = []
            for layer, expert, loc in c.iter_records():
                per_layer[layer] = per_layer.get(layer, 0) + loc.padded_length
                per_file.setdefault(loc.file, []).append((layer, expert))
                lengths.append(loc.length)
                padded.append(loc.padded_length)
            return cls(
                path=path,
                manifest=c.manifest,
                config=c.config,
                dims=ModelDims.from_config(c.family, c.config),
                family=c.family,
                fingerprint=c.fingerprint,
                format_version=int(c.manifest["format_version"]),
                bytes_by_role=by_role,
                expert_layers=tuple(c.expert_layers),
                num_experts=c.num_experts,
                records=c.num_records,
                bytes_per_expert=max(lengths, default=0),
                padded_bytes_per_expert=max(padded, default=0),
                bytes_per_layer=per_layer,
                records_per_file=per_file,
            )

    @property
    def decoder_expert_layers(self) -> tuple[int, ...]:
        """Expert layers a decoded token passes through (MTP layers, used only for drafting, left out)."""
        return tuple(layer for layer in self.expert_layers if layer < self.dims.layers) or self.expert_layers

    @property
    def tokenizer_file(self) -> str | None:
        return next((n for n in TOKENIZER_FILES if n in self.manifest["files"]), None)

    def to_json(self) -> dict:
        source = self.manifest.get("source") or {}
        return {
            "path": str(self.path),
            "format_version": self.format_version,
            "family": self.family,
            "writer": self.manifest.get("writer"),
            "fingerprint": self.fingerprint,
            "source": {k: v for k, v in source.items() if k != "files"} | {"files": len(source.get("files") or {})},
            "recipe": self.manifest.get("recipe", {}),
            "dims": self.dims.to_json(),
            "sizes": {
                "resident": self.bytes_by_role.get("resident", 0),
                "mtp": self.bytes_by_role.get("mtp", 0),
                "experts": self.bytes_by_role.get("experts", 0),
                "index": self.bytes_by_role.get("index", 0),
                "verbatim": self.bytes_by_role.get("verbatim", 0),
                "total": sum(self.bytes_by_role.values()),
                "bytes_per_expert": self.bytes_per_expert,
                "padded_bytes_per_expert": self.padded_bytes_per_expert,
                "per_layer": {str(k): v for k, v in sorted(self.bytes_per_layer.items())},
            },
            "experts": {
                "layers": list(self.expert_layers),
                "num_experts": self.num_experts,
                "records": self.records,
                "shapes": self.manifest.get("experts", {}).get("shapes", {}),
            },
            "files": {
                role: sorted(n for n, i in self.manifest["files"].items() if i["role"] == role)
                for role in ("verbatim", "resident", "mtp", "experts", "index")
            },
            "tokenizer": self.tokenizer_file,
            "chat_template": any(n.startswith("chat_template") for n in self.manifest["files"])
            or "chat_template" in str(self.manifest["files"]),
        }


@dataclass(frozen=True)
class Usage:
    """Routing counts of the container's expert layers: counts[i, e] for layer expert_layers[i]."""

    path: Path
    layers: tuple[int, ...]
    counts: np.ndarray
    turns: int
    decay: float

    @property
    def total(self) -> float:
        return float(self.counts.sum())


def usage_candidates(facts: ContainerFacts) -> list[Path]:
    return [facts.path / USAGE_FILE_NAME, default_usage_path(facts.path, facts.fingerprint)]


def load_usage(facts: ContainerFacts, path: Path | None = None) -> tuple[Usage | None, str | None]:
    """The container's usage history, or (None, why not). An explicit `path` that cannot be read is an error."""
    candidates = [Path(path)] if path is not None else usage_candidates(facts)
    why = None
    for p in dict.fromkeys(candidates):
        if not p.is_file():
            continue
        try:
            u = UsageCounts.load(p, expect_fingerprint=facts.fingerprint)
        except SidecarError as exc:
            if path is not None:
                raise
            why = f"{p}: {exc}"
            continue
        rows, experts = u.counts.shape
        layers = tuple(layer for layer in facts.expert_layers if layer < rows)
        if experts != facts.num_experts or not layers:
            why = f"{p}: usage dims {rows} x {experts} do not fit the container's {facts.num_experts} experts per layer"
            if path is not None:
                raise SidecarError(why)
            continue
        return Usage(p, layers, u.counts[list(layers)].astype(np.float64), u.turns, u.decay), None
    return None, why or "no .coli_usage yet (it is written as the model runs)"
