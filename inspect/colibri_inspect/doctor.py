"""Readiness of this machine for one container, read-only: memory, drives, O_DIRECT, numba, tokenizer, family.

Every check returns a `Check` whose `status` is "ok", "warn" (works, but slower or degraded) or "fail" (will not
run), and whose `advice` says what to do. Nothing here writes to the container or its drives.
"""

from __future__ import annotations

import importlib
import importlib.util
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

from colibri_format.constants import RECORD_ALIGNMENT
from colibri_format.errors import ColibriError

from .facts import ContainerFacts
from .plan import DEFAULT_CONTEXT, PlanInputs, default_os_reserve, make_plan, runtime_working_bytes
from .scan import measure_read_bandwidth

OK, WARN, FAIL = "ok", "warn", "fail"
DEFAULT_PROBE_BYTES = 256 * 1024**2
SLOW_DRIVE_GBPS = 1.0
MIN_PROBE_BYTES = 16 * 1024**2


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    message: str
    advice: str = ""

    def to_json(self) -> dict:
        return {"name": self.name, "status": self.status, "message": self.message, "advice": self.advice}


def check_memory(facts: ContainerFacts, available_bytes: int, context: int = DEFAULT_CONTEXT) -> Check:
    dims = facts.dims
    layers = facts.decoder_expert_layers
    plan = make_plan(
        PlanInputs(
            dense_bytes=facts.bytes_by_role.get("resident", 0),
            bytes_per_expert=facts.bytes_per_expert,
            layers=layers,
            num_experts=facts.num_experts,
            top_k=dims.top_k,
            kv_bytes_per_token=dims.kv_bytes_per_token(),
            ram_bytes=available_bytes,
            context=context,
            os_reserve_bytes=0,
            working_bytes=runtime_working_bytes(dims.top_k, facts.bytes_per_expert),
        )
    )
    need = plan.inputs.dense_bytes + plan.kv_bytes + plan.inputs.working_bytes
    minimal = need + dims.top_k * len(layers) * facts.bytes_per_expert
    msg = (
        f"{_gib(available_bytes)} available; dense weights {_gib(plan.inputs.dense_bytes)}, KV cache for {context} "
        f"tokens {_gib(plan.kv_bytes)}, buffers {_gib(plan.inputs.working_bytes)}: the expert cache gets "
        f"{plan.cache_per_layer + len(plan.pinned) // max(1, len(layers))} of {facts.num_experts} experts per layer"
    )
    if available_bytes < need:
        return Check("memory", FAIL, msg, f"free at least {_gib(need - available_bytes)} of RAM, or lower --context")
    if available_bytes < minimal or plan.slots // max(1, len(layers)) < dims.top_k:
        return Check("memory", WARN, msg, "the cache cannot hold one token's experts: expect disk-speed decoding; free RAM")
    return Check("memory", OK, msg)


def _device_of(path: Path) -> int:
    return os.stat(path).st_dev


def check_drives(paths: list[Path], facts_by_path: dict[Path, list[Path]], probe_bytes: int) -> list[Check]:
    """One bandwidth measurement per drive (st_dev) holding the container or a mirror."""
    by_device: dict[int, list[Path]] = {}
    for root in paths:
        files = facts_by_path.get(root) or []
        if not files:
            continue
        by_device.setdefault(_device_of(files[0]), []).extend(files)
    checks = []
    for files in by_device.values():
        roots = sorted({str(f.parent) for f in files})
        try:
            bw = measure_read_bandwidth(files, max_bytes=probe_bytes, jobs=2)
        except OSError as exc:
            checks.append(Check("drive", FAIL, f"{', '.join(roots)}: read failed ({exc.strerror})", "check the drive"))
            continue
        temp = "cold" if bw.cold else "possibly cached"
        if bw.nbytes < MIN_PROBE_BYTES:
            checks.append(Check("drive", OK, f"{', '.join(roots)}: only {bw.nbytes} bytes of data, too few to measure"))
            continue
        msg = f"{', '.join(roots)}: {bw.gbps:.2f} GB/s sequential read ({bw.nbytes / 1e6:.0f} MB, {temp})"
        if bw.gbps < SLOW_DRIVE_GBPS:
            checks.append(Check("drive", WARN, msg, "a slow drive bounds decode speed: put the container (or a mirror) on NVMe"))
        else:
            checks.append(Check("drive", OK, msg))
    return checks


def check_o_direct(path: Path) -> Check:
    """Open a data file with O_DIRECT and read one aligned block into an mmap-allocated (page-aligned) buffer."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return Check("o_direct", WARN, "this platform has no O_DIRECT", "run without direct I/O (the default)")
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError as exc:
        return Check(
            "o_direct", WARN, f"{path.parent}: the filesystem refuses O_DIRECT ({exc.strerror})",
            "run without direct I/O; reads go through the page cache",
        )
    try:
        buf = mmap.mmap(-1, RECORD_ALIGNMENT)
        try:
            n = os.preadv(fd, [buf], 0)
        finally:
            buf.close()
    except OSError as exc:
        return Check(
            "o_direct", WARN, f"{path.parent}: aligned O_DIRECT read failed ({exc.strerror})",
            "run without direct I/O; reads go through the page cache",
        )
    finally:
        os.close(fd)
    return Check(
        "o_direct", OK, f"{path.parent}: O_DIRECT reads work ({n} bytes aligned read)",
        "measure decode with and without direct I/O: it helps on some drives and hurts on DRAM-less or virtual ones",
    )


def check_numba() -> Check:
    try:
        import numba
    except Exception as exc:
        return Check("numba", FAIL, f"numba does not import ({exc})", "pip install numba (the runtime's kernels need it)")
    start = time.perf_counter()
    try:
        @numba.njit(cache=False)
        def _probe(n):  # pragma: no cover - compiled
            s = 0
            for i in range(n):
                s += i
            return s

        assert _probe(10) == 45
    except Exception as exc:
        return Check("numba", FAIL, f"numba {numba.__version__} cannot compile ({exc})", "reinstall numba and llvmlite")
    return Check("numba", OK, f"numba {numba.__version__} compiles ({time.perf_counter() - start:.2f} s)")


def check_tokenizer(facts: ContainerFacts) -> Check:
    name = facts.tokenizer_file
    if name is None:
        return Check("tokenizer", FAIL, "the container holds no tokenizer.json", "re-convert with the tokenizer files")
    if name != "tokenizer.json":
        return Check("tokenizer", WARN, f"only {name} (no tokenizer.json)", "re-convert from a checkpoint with tokenizer.json")
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(facts.path / name))
        size = tok.get_vocab_size()
    except Exception as exc:
        return Check("tokenizer", FAIL, f"tokenizer.json does not load ({exc})", "re-download tokenizer.json")
    vocab = facts.dims.vocab
    if vocab and size > vocab:
        return Check("tokenizer", FAIL, f"tokenizer has {size} tokens, the model only {vocab}", "the tokenizer belongs to another model")
    return Check("tokenizer", OK, f"tokenizer.json loads ({size} tokens)")


def check_family(family: str) -> Check:
    try:
        registry = importlib.import_module("colibri_runtime.families")
    except Exception as exc:
        return Check("family", WARN, f"the runtime is not importable ({exc})", "install colibri with its runtime")
    get_family = getattr(registry, "get_family", None)
    if callable(get_family):
        try:
            get_family(family)
        except ColibriError as exc:
            return Check("family", FAIL, str(exc), "upgrade Colibri, or run another model")
        except Exception as exc:
            return Check("family", WARN, f"family {family!r} is registered but its module fails to import ({exc})",
                         "reinstall Colibri")
        return Check("family", OK, f"the runtime supports {family}")
    if importlib.util.find_spec(f"colibri_runtime.families.{family}") is not None:
        return Check("family", OK, f"the runtime supports {family}")
    return Check("family", FAIL, f"the runtime has no module for family {family!r}", "upgrade Colibri, or run another model")


def run_doctor(
    path: Path,
    *,
    mirrors: list[Path] | None = None,
    context: int = DEFAULT_CONTEXT,
    probe_bytes: int = DEFAULT_PROBE_BYTES,
    available_bytes: int | None = None,
) -> list[Check]:
    path = Path(path)
    try:
        facts = ContainerFacts.load(path)
    except ColibriError as exc:
        return [Check("container", FAIL, str(exc), f"run `colibri-inspect verify {path}` for every problem")]
    checks = [Check("container", OK, f"{facts.family} container, format v{facts.format_version}, opens cleanly")]
    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    checks.append(check_memory(facts, available_bytes, context))
    data = [path / n for n in sorted(facts.records_per_file)] or [path / n for n in sorted(facts.manifest["files"])]
    roots = [path] + [Path(m) for m in mirrors or []]
    files_by_root = {path: data}
    for m in mirrors or []:
        files_by_root[Path(m)] = [Path(m) / f.name for f in data if (Path(m) / f.name).is_file()]
    checks.extend(check_drives(roots, files_by_root, probe_bytes))
    if data:
        checks.append(check_o_direct(data[0]))
    checks.append(check_numba())
    checks.append(check_tokenizer(facts))
    checks.append(check_family(facts.family))
    return checks


def ready(checks: list[Check]) -> bool:
    return all(c.status != FAIL for c in checks)


def _gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GiB"


__all__ = ["Check", "default_os_reserve", "ready", "run_doctor"]
