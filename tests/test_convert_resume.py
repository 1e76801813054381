"""colibri-convert resumability and edges: SIGKILL at several points then rerun gives a byte-identical container;
changed parameters refused; the free-space floor stops resumably; the lock; a Hub source through a local stand-in;
publish (dry run, upload inputs, refusal of a corrupt container); the CLI's one-line errors."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models as tm
from colibri_convert import convert as convert_mod
from colibri_convert.cli import app
from colibri_convert.convert import CRASH_ENV, LOCK_NAME, DiskFloorReached, convert
from colibri_convert.publish import publish
from colibri_convert.sources import FolderHubClient, HubSource, LocalSource
from typer.testing import CliRunner

from colibri_format.constants import MANIFEST_NAME
from colibri_format.errors import ColibriError, ConversionError
from colibri_format.reader import Container

SHARDS = 4


def all_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    src = tm.save_tiny_checkpoint("glm_moe_dsa", root / "src", num_shards=SHARDS)
    convert(LocalSource(src), root / "reference")
    return src, all_files(root / "reference")


def _run_cli(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    code = "from colibri_convert.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("crash_at", ["unit1:files", "unit2:committed", "finalize:renamed", "finalize:done"])
def test_sigkill_then_rerun_is_byte_identical(checkpoint, tmp_path, crash_at):
    src, reference = checkpoint
    out = tmp_path / "out"
    killed = _run_cli(["convert", str(src), str(out), "--quiet"], {CRASH_ENV: crash_at})
    assert killed.returncode == -9, killed.stderr
    if not crash_at.startswith("finalize:done"):
        assert not (out / MANIFEST_NAME).exists()
    convert(LocalSource(src), out)
    assert all_files(out) == reference


def test_changed_parameters_refused_and_restart(checkpoint, tmp_path, monkeypatch):
    src, reference = checkpoint
    out = tmp_path / "out"
    calls = iter([10 * 2**30, 0, 0, 0])
    monkeypatch.setattr(convert_mod, "free_bytes", lambda path: next(calls))
    with pytest.raises(DiskFloorReached, match="floor"):
        convert(LocalSource(src), out, min_free_gb=1.0)
    assert len(list((out / ".colibri-convert" / "units").iterdir())) == 1
    monkeypatch.undo()
    with pytest.raises(ConversionError, match=r"recipe\.attention: 'int4_gs64' -> 'int8_gs64'.*--restart"):
        convert(LocalSource(src), out, {"attention": "int8_gs64"})
    convert(LocalSource(src), out, {"attention": "int8_gs64"}, restart=True)
    with Container.open(out) as c:
        assert c.manifest["recipe"]["attention"] == "int8_gs64"
    with pytest.raises(ConversionError, match="already holds a finished container"):
        convert(LocalSource(src), out)
    convert(LocalSource(src), out, restart=True)
    assert all_files(out) == reference


def test_disk_floor_stop_is_resumable(checkpoint, tmp_path, monkeypatch):
    src, reference = checkpoint
    out = tmp_path / "out"
    free = iter([5 * 2**30, 5 * 2**30, 2**20])
    monkeypatch.setattr(convert_mod, "free_bytes", lambda path: next(free))
    with pytest.raises(DiskFloorReached, match="run the same command again to resume"):
        convert(LocalSource(src), out, min_free_gb=2.0)
    assert not (out / MANIFEST_NAME).exists()
    with pytest.raises(ColibriError):
        Container.open(out)
    monkeypatch.setattr(convert_mod, "free_bytes", lambda path: 5 * 2**30)
    summary = convert(LocalSource(src), out, min_free_gb=2.0)
    assert summary.units_resumed == 2
    assert all_files(out) == reference


def test_second_converter_is_locked_out(checkpoint, tmp_path):
    src, _ = checkpoint
    out = tmp_path / "out"
    out.mkdir()
    with open(out / LOCK_NAME, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ConversionError, match="another colibri-convert"):
            convert(LocalSource(src), out)


def test_hub_source_one_shard_at_a_time(checkpoint, tmp_path):
    src, reference = checkpoint
    client = FolderHubClient(src, revision="a" * 40)
    out = tmp_path / "out"
    scratch_seen = []
    download = client.download

    def watching_download(name, local_dir):
        present = [p.name for p in Path(local_dir).rglob("model-*.safetensors")]
        scratch_seen.append(present)
        return download(name, local_dir)

    client.download = watching_download
    convert(HubSource("org/tiny-glm5", client=client), out)
    shards = [n for n in client.downloads if n.startswith("model-")]
    assert shards == sorted(shards) and len(shards) == SHARDS
    assert all(not present for present in scratch_seen)  # the previous shard was deleted before the next download
    got = all_files(out)
    manifest = json.loads(got.pop(MANIFEST_NAME))
    assert manifest["source"]["repo"] == "org/tiny-glm5" and manifest["source"]["revision"] == "a" * 40
    assert len(manifest["source"]["files"]) > SHARDS
    ref = dict(reference)
    ref.pop(MANIFEST_NAME)
    assert got == ref


class FakeApi:
    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", repo_id, kw))

    def upload_large_folder(self, **kw):
        self.calls.append(("upload_large_folder", kw))


def test_publish_dry_run_upload_and_refusal(checkpoint, tmp_path):
    src, _ = checkpoint
    out = tmp_path / "out"
    convert(LocalSource(src), out)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    files = publish(out, "me/tiny", dry_run=True)
    names = [f.name for f in files]
    assert set(names) == set(manifest["files"]) | {MANIFEST_NAME, "README.md"}
    assert not (out / "README.md").exists()
    api = FakeApi()
    publish(out, "me/tiny", api=api)
    (_, repo, _), (_, kw) = api.calls
    assert repo == "me/tiny" and kw["repo_id"] == "me/tiny" and kw["folder_path"] == str(out)
    assert sorted(kw["allow_patterns"]) == sorted(names)
    card = (out / "README.md").read_text()
    assert "glm_moe_dsa" in card and "int4_gs64" in card and 'colibri-run generate --model' in card
    assert "worst relative RMSE" in card
    expert_file = next(n for n in manifest["files"] if n.startswith("experts-"))
    data = bytearray((out / expert_file).read_bytes())
    data[5000] ^= 0xFF
    (out / expert_file).write_bytes(bytes(data))
    with pytest.raises(ColibriError, match="refusing to publish"):
        publish(out, "me/tiny", api=FakeApi())


def test_cli_errors_are_one_line(tmp_path):
    runner = CliRunner()
    src = tm.save_tiny_checkpoint("olmoe", tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (src / "config.json").write_text(json.dumps(cfg))
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "out"), "--quiet"])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "gpt2" in lines[0] and "supported model types" in lines[0]
    result = runner.invoke(app, ["publish", str(tmp_path / "nothing"), "me/x", "--dry-run"])
    assert result.exit_code == 1 and "refusing to publish" in result.output
