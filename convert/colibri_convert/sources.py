"""Where a checkpoint comes from: a local folder or a Hugging Face Hub repository, behind one small interface.

A source lists its safetensors shards (from model.safetensors.index.json, or the single model.safetensors), hands
out small files (config.json, tokenizer files) as bytes, and makes one shard available as a local file at a time
(`open_shard`, a context manager): a Hub source downloads it and deletes it afterwards, so a conversion never needs
the whole checkpoint on disk.

Hub access goes through a `HubClient` (list files, resolve the revision, download one file); tests substitute a
folder-backed client with the Hub's file layout, so no test touches the network.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from colibri_format.constants import VERBATIM_FILES
from colibri_format.errors import ConversionError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class ShardInfo:
    name: str
    size: int | None  # None when the source cannot tell before downloading


class Source:
    """Interface of a checkpoint source."""

    kind = "abstract"

    def identity(self) -> dict:
        """What identifies this source in resume parameters (a rerun must name the same one)."""
        raise NotImplementedError

    def manifest_source(self) -> dict:
        """The container manifest's `source` block, without file hashes."""
        raise NotImplementedError

    def read_small(self, name: str) -> bytes | None:
        """A small file of the checkpoint, or None if it has none of that name."""
        raise NotImplementedError

    def shards(self) -> list[ShardInfo]:
        raise NotImplementedError

    def weight_map(self) -> dict[str, str] | None:
        """tensor name -> shard name, from the index file; None for a single-file checkpoint."""
        raw = self.read_small(INDEX_NAME)
        if raw is None:
            return None
        try:
            index = json.loads(raw)
            return {str(k): str(v) for k, v in index["weight_map"].items()}
        except (json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise ConversionError(f"{INDEX_NAME} of this checkpoint is malformed ({exc!r}); re-download it") from None

    def config(self) -> dict:
        raw = self.read_small("config.json")
        if raw is None:
            raise ConversionError("the checkpoint has no config.json; point SOURCE at a Hugging Face model folder")
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConversionError(f"config.json is not valid JSON ({exc})") from None

    def verbatim_files(self) -> dict[str, bytes]:
        out = {}
        for name in VERBATIM_FILES:
            data = self.read_small(name)
            if data is not None:
                out[name] = data
        return out

    @contextmanager
    def open_shard(self, name: str, scratch: Path) -> Iterator[Path]:
        raise NotImplementedError
        yield


def _shards_from(weight_map: dict[str, str] | None, single_exists: bool) -> list[str]:
    if weight_map is not None:
        return sorted(set(weight_map.values()))
    if single_exists:
        return [SINGLE_NAME]
    raise ConversionError(f"the checkpoint has neither {INDEX_NAME} nor {SINGLE_NAME}; nothing to convert")


class LocalSource(Source):
    """A checkpoint folder on local disk."""

    kind = "local"

    def __init__(self, path: Path):
        self.path = Path(path).resolve()
        if not self.path.is_dir():
            raise ConversionError(f"{self.path} is not a directory (give a checkpoint folder or a Hub repo id)")

    def identity(self) -> dict:
        return {"kind": self.kind, "path": str(self.path)}

    def manifest_source(self) -> dict:
        return {"repo": self.path.name, "revision": None}

    def read_small(self, name: str) -> bytes | None:
        p = self.path / name
        return p.read_bytes() if p.is_file() else None

    def shards(self) -> list[ShardInfo]:
        names = _shards_from(self.weight_map(), (self.path / SINGLE_NAME).is_file())
        out = []
        for name in names:
            p = self.path / name
            if not p.is_file():
                raise ConversionError(f"shard {name} named by {INDEX_NAME} is missing from {self.path}")
            out.append(ShardInfo(name, p.stat().st_size))
        return out

    @contextmanager
    def open_shard(self, name: str, scratch: Path) -> Iterator[Path]:
        yield self.path / name


class HubClient(Protocol):
    def list_files(self) -> list[str]: ...

    def resolved_revision(self) -> str | None: ...

    def file_size(self, name: str) -> int | None: ...

    def download(self, name: str, local_dir: Path) -> Path: ...


class HuggingFaceHubClient:
    """The real Hub, through huggingface_hub."""

    def __init__(self, repo_id: str, revision: str | None = None):
        self.repo_id = repo_id
        self.revision = revision
        self._info = None

    def _repo_info(self):
        if self._info is None:
            from huggingface_hub import HfApi

            try:
                self._info = HfApi().model_info(self.repo_id, revision=self.revision, files_metadata=True)
            except Exception as exc:  # network, auth, not found: one message for all
                raise ConversionError(
                    f"cannot reach Hub repo {self.repo_id!r} (revision {self.revision or 'main'}): {exc}; check the "
                    "name, your network and HF_TOKEN"
                ) from None
        return self._info

    def list_files(self) -> list[str]:
        return [s.rfilename for s in self._repo_info().siblings]

    def resolved_revision(self) -> str | None:
        return self._repo_info().sha

    def file_size(self, name: str) -> int | None:
        for s in self._repo_info().siblings:
            if s.rfilename == name:
                return s.size
        return None

    def download(self, name: str, local_dir: Path) -> Path:
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(self.repo_id, name, revision=self.resolved_revision(), local_dir=local_dir))
        except Exception as exc:
            raise ConversionError(f"downloading {name} from {self.repo_id} failed: {exc}; rerun to resume") from None


class HubSource(Source):
    """A Hub model repository, fetched one file at a time into a scratch folder."""

    kind = "hub"

    def __init__(self, repo_id: str, revision: str | None = None, client: HubClient | None = None,
                 scratch: Path | None = None):
        self.repo_id = repo_id
        self.client = client or HuggingFaceHubClient(repo_id, revision)
        self.revision = self.client.resolved_revision() or revision
        self.scratch = scratch
        self._files = set(self.client.list_files())
        self._small: dict[str, bytes | None] = {}

    def identity(self) -> dict:
        return {"kind": self.kind, "repo": self.repo_id, "revision": self.revision}

    def manifest_source(self) -> dict:
        return {"repo": self.repo_id, "revision": self.revision}

    def read_small(self, name: str) -> bytes | None:
        if name not in self._small:
            if name not in self._files:
                self._small[name] = None
            else:
                if self.scratch is None:
                    raise ConversionError("internal: HubSource needs a scratch folder before reading files")
                self.scratch.mkdir(parents=True, exist_ok=True)
                path = self.client.download(name, self.scratch)
                self._small[name] = Path(path).read_bytes()
                Path(path).unlink(missing_ok=True)
        return self._small[name]

    def shards(self) -> list[ShardInfo]:
        names = _shards_from(self.weight_map(), SINGLE_NAME in self._files)
        missing = [n for n in names if n not in self._files]
        if missing:
            raise ConversionError(f"{self.repo_id}: shards named by {INDEX_NAME} are missing: {', '.join(missing)}")
        return [ShardInfo(n, self.client.file_size(n)) for n in names]

    @contextmanager
    def open_shard(self, name: str, scratch: Path) -> Iterator[Path]:
        scratch.mkdir(parents=True, exist_ok=True)
        path = Path(self.client.download(name, scratch))
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)


class FolderHubClient:
    """A stand-in for the Hub backed by a local folder with the Hub's file layout (tests, air-gapped mirrors)."""

    def __init__(self, root: Path, revision: str = "0" * 40):
        self.root = Path(root)
        self.revision = revision
        self.downloads: list[str] = []

    def list_files(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())

    def resolved_revision(self) -> str | None:
        return self.revision

    def file_size(self, name: str) -> int | None:
        p = self.root / name
        return p.stat().st_size if p.is_file() else None

    def download(self, name: str, local_dir: Path) -> Path:
        self.downloads.append(name)
        target = Path(local_dir) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".incomplete")
        shutil.copyfile(self.root / name, tmp)
        os.replace(tmp, target)
        return target


def open_source(spec: str, revision: str | None = None) -> Source:
    """A local folder if `spec` names an existing directory, else a Hub repo id."""
    if Path(spec).expanduser().is_dir():
        if revision:
            raise ConversionError("--revision applies to Hub sources only; SOURCE is a local folder")
        return LocalSource(Path(spec).expanduser())
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        raise ConversionError(f"{spec!r} is neither an existing folder nor a Hub repo id like 'org/name'")
    return HubSource(spec, revision)
