"""publish: upload a verified container to a Hugging Face Hub model repository, with a generated model card.

The container is opened (structure, sizes, index) and every file's sha256 is checked against the manifest before
anything is uploaded; a container that fails is refused. The upload uses huggingface_hub's resumable
`upload_large_folder`; --dry-run lists exactly the files and sizes that would be uploaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from colibri_format.constants import MANIFEST_NAME
from colibri_format.errors import ColibriError, ConversionError, IntegrityError
from colibri_format.reader import Container
from colibri_format.safetensors_io import sha256_file
from colibri_format.units import human_bytes

CARD_NAME = "README.md"


@dataclass(frozen=True)
class UploadFile:
    name: str
    size: int


def verify_container(path: Path) -> dict:
    """Open the container and check every file against the manifest's sha256; return the manifest."""
    try:
        with Container.open(path) as c:
            manifest = c.manifest
    except ColibriError as exc:
        raise ConversionError(f"refusing to publish {path}: it fails verification ({exc})") from None
    for name, info in sorted(manifest["files"].items()):
        if sha256_file(Path(path) / name) != info["sha256"]:
            raise IntegrityError(f"refusing to publish {path}: {name} does not match its manifest checksum; "
                                 "re-convert or re-download it")
    return manifest


def model_card(manifest: dict, repo_id: str) -> str:
    """The README.md of a published container."""
    src = manifest.get("source", {})
    base = src.get("repo") or "unknown"
    extra = manifest.get("extra", {})
    experts = manifest.get("experts", {})
    sizes: dict[str, int] = {}
    for info in manifest["files"].values():
        sizes[info["role"]] = sizes.get(info["role"], 0) + info["size"]
    lines = [
        "---",
        f"base_model: {base}",
        "library_name: colibri",
        "tags:",
        "- colibri",
        "- mixture-of-experts",
        f"- {manifest['family']}",
        "---",
        "",
        f"# {repo_id.split('/')[-1]}",
        "",
        f"A Colibri container (format version {manifest['format_version']}) of [{base}](https://huggingface.co/{base})"
        f" (revision `{src.get('revision') or 'local'}`), family `{manifest['family']}`. Routed experts are streamed "
        "from disk on demand, so the model runs on machines with far less memory than its size.",
        "",
        "## Recipe",
        "",
        "| tensor class | encoding | worst relative RMSE |",
        "|---|---|---|",
    ]
    quant = extra.get("quantization", {})
    for cls, enc in sorted(manifest.get("recipe", {}).items()):
        q = quant.get(cls)
        lines.append(f"| {cls} | {enc} | {q['worst_relative_rmse']:.4f} |" if q else f"| {cls} | {enc} | - |")
    lines += [
        "",
        "## Sizes",
        "",
        "| role | bytes |",
        "|---|---|",
    ]
    lines += [f"| {role} | {human_bytes(n)} |" for role, n in sorted(sizes.items())]
    lines += [
        f"| total | {human_bytes(sum(sizes.values()))} |",
        "",
        f"Experts: {experts.get('records', 0)} records over {len(experts.get('layers', []))} layers, "
        f"{experts.get('num_experts', 0)} per layer. MTP layers: {extra.get('mtp', {}).get('layers', [])}.",
        "",
        f"Fingerprint: `{manifest['fingerprint']}`",
        "",
        "## How to run",
        "",
        "```bash",
        "pip install colibri",
        f"huggingface-cli download {repo_id} --local-dir ./model",
        "colibri-inspect verify ./model",
        'colibri-run generate --model ./model "prompt"',
        "```",
        "",
    ]
    return "\n".join(lines)


def upload_plan(container: Path) -> list[UploadFile]:
    """The files publish uploads: the manifest, every file it lists, and the model card."""
    manifest = json.loads((Path(container) / MANIFEST_NAME).read_text())
    files = [UploadFile(MANIFEST_NAME, (Path(container) / MANIFEST_NAME).stat().st_size)]
    files += [UploadFile(name, int(info["size"])) for name, info in sorted(manifest["files"].items())]
    return files


def publish(container: Path, repo_id: str, *, dry_run: bool = False, private: bool = False,
            api=None) -> list[UploadFile]:
    """Verify, write the model card, and upload (unless dry_run). Returns the files (to be) uploaded."""
    container = Path(container)
    manifest = verify_container(container)
    card = model_card(manifest, repo_id)
    files = upload_plan(container) + [UploadFile(CARD_NAME, len(card.encode("utf-8")))]
    if dry_run:
        return files
    (container / CARD_NAME).write_text(card)
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    allow = [f.name for f in files]
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_large_folder(repo_id=repo_id, folder_path=str(container), repo_type="model",
                                allow_patterns=allow, private=private)
    except ColibriError:
        raise
    except Exception as exc:
        raise ConversionError(f"upload to {repo_id} failed: {exc}; run publish again to resume") from None
    return files
