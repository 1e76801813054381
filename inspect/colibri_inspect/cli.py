"""Command line of colibri_inspect: describe, verify, mirror, plan and check readiness for Colibri containers.

The library modules (facts, verify, mirror, plan, doctor, heatmap) return data and never print; this module renders
it, draws progress bars, and turns ColibriError into one line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from colibri_format.errors import ColibriError
from colibri_format.units import human_bytes as human

app = typer.Typer(help="Verify and plan Colibri containers.", no_args_is_help=True, add_completion=False)
mirror_app = typer.Typer(help="Verify and stage mirrors of a container on other drives.", no_args_is_help=True)
app.add_typer(mirror_app, name="mirror")

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False)

GIB = 1024**3


def fail(message: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(code)


def emit_json(data: dict) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


@contextmanager
def byte_progress(total: int, description: str, enabled: bool = True) -> Iterator:
    """A progress bar over bytes on stderr; yields a thread-safe `advance(nbytes)` callable."""
    if not enabled or total <= 0:
        yield None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    ) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


def load_facts(path: Path):
    from .facts import ContainerFacts

    try:
        return ContainerFacts.load(path)
    except ColibriError as exc:
        fail(f"{exc} (run `colibri-inspect verify {path}` to list every problem)")


# --- info ------------------------------------------------------------------------------------------------------


@app.command()
def info(path: Path = typer.Argument(..., help="Container directory"), as_json: bool = typer.Option(False, "--json")) -> None:
    """Family, dimensions, recipe, sizes, tokenizer, source and format version of a container."""
    from .facts import load_usage

    facts = load_facts(path)
    data = facts.to_json()
    usage, _ = load_usage(facts)
    data["usage"] = None if usage is None else {"path": str(usage.path), "turns": usage.turns}
    if as_json:
        emit_json(data)
        return
    d, s = data["dims"], data["sizes"]
    src = data["source"]
    out.print(f"[bold]{escape(str(path))}[/]: Colibri container, format v{data['format_version']}, family [bold]{data['family']}[/]")
    out.print(f"  source        {src.get('repo') or '-'} @ {src.get('revision') or '-'} ({src['files']} source files)")
    out.print(f"  fingerprint   {data['fingerprint']}")
    out.print(f"  writer        {data['writer']}")
    out.print(
        f"  model         {d['layers']} layers, hidden {d['hidden_size']}, vocab {d['vocab_size']}, "
        f"{d['attention_heads']} heads ({d['attention']}, {d['kv_heads']} KV heads, head_dim {d['head_dim']})"
    )
    out.print(
        f"  experts       {d['num_experts']} routed per layer, top-{d['experts_per_token']}, width "
        f"{d['moe_intermediate_size']}, {d['moe_layers']} MoE layers (first {d['first_moe_layer']}), "
        f"{d['shared_experts']} shared, {d['mtp_layers']} MTP layers"
    )
    out.print(f"  records       {data['experts']['records']} in {len(data['files']['experts'])} data files, layers "
              f"{_span(data['experts']['layers'])}")
    out.print("  recipe        " + (", ".join(f"{k}={v}" for k, v in data["recipe"].items()) or "-"))
    out.print(
        f"  sizes         resident {human(s['resident'])}, mtp {human(s['mtp'])}, experts {human(s['experts'])}, "
        f"total {human(s['total'])}"
    )
    per_layer = list(s["per_layer"].values())
    if per_layer:
        out.print(
            f"                per expert {human(s['bytes_per_expert'])} ({s['bytes_per_expert']} B, "
            f"{human(s['padded_bytes_per_expert'])} on disk), per layer {human(max(per_layer))}"
        )
    out.print(f"  tokenizer     {data['tokenizer'] or 'none'}{', chat template' if data['chat_template'] else ''}")
    out.print(f"  usage         {'none yet' if usage is None else f'{usage.path} ({usage.turns} turns)'}")


def _span(layers: list[int]) -> str:
    if not layers:
        return "none"
    return f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else ", ".join(map(str, layers))


# --- verify ------------------------------------------------------------------------------------------------------


@app.command()
def verify(
    path: Path = typer.Argument(..., help="Container directory"),
    deep: bool = typer.Option(False, "--deep", help="Also read every byte: checksums, finite scales"),
    as_json: bool = typer.Option(False, "--json"),
    crc_only: bool = typer.Option(
        False, "--crc-only", help="With --deep: check expert data files by record crc32 only, not sha256 (faster on slow CPUs)"
    ),
    jobs: int | None = typer.Option(None, "--jobs", help="Files read at once (default: half the cores, at most 8)"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
) -> None:
    """Report every problem of a container. Exit 0 when sound, 1 when not."""
    from .verify import bytes_to_scan, verify_container

    total = bytes_to_scan(path) if deep else 0
    with byte_progress(total, "verifying", progress and not as_json) as advance:
        report = verify_container(path, deep=deep, progress=advance, jobs=jobs, crc_only=crc_only)
    if as_json:
        emit_json(report.to_json())
        raise typer.Exit(0 if report.ok else 1)
    for f in report.findings:
        colour = "red" if f.severity == "error" else "yellow"
        where = f"{f.file}: " if f.file and not f.message.startswith(f.file) else ""
        out.print(f"[{colour}]{f.severity:7}[/] {escape(f'[{f.code}] {where}{f.message}')}")
    for code, n in report.suppressed.items():
        out.print(f"[dim]... and {n} more {escape(f'[{code}]')} findings[/]")
    kind = ("deep (crc only)" if crc_only else "deep") if deep else "fast"
    summary = (
        f"{kind} verify: {report.files_checked} files, {report.tensors_checked} tensors, "
        f"{report.records_checked} expert records; {len(report.errors)} errors, {len(report.warnings)} warnings "
        f"({report.seconds:.2f} s)"
    )
    if deep and report.bytes_read:
        summary += f"; read {human(report.bytes_read)} at {report.read_gbps:.2f} GB/s"
    out.print(("[green]sound[/] " if report.ok else "[red]NOT sound[/] ") + summary)
    raise typer.Exit(0 if report.ok else 1)


# --- mirror ------------------------------------------------------------------------------------------------------


@mirror_app.command("verify")
def mirror_verify(
    primary: Path = typer.Argument(..., help="Primary container directory"),
    mirrors: list[Path] = typer.Argument(..., help="Mirror directories"),
    as_json: bool = typer.Option(False, "--json"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
) -> None:
    """Which of the primary's files each mirror holds, byte-identical or not. Exit 1 if a mirror is corrupt."""
    from .mirror import mirror_bytes_to_hash, verify_mirror

    reports = []
    try:
        for m in mirrors:
            with byte_progress(mirror_bytes_to_hash(primary, m), f"hashing {m.name}", progress and not as_json) as adv:
                reports.append(verify_mirror(primary, m, progress=adv))
    except ColibriError as exc:
        fail(str(exc))
    if as_json:
        emit_json({"primary": str(primary), "mirrors": [r.to_json() for r in reports]})
    else:
        for r in reports:
            colour = {"full": "green", "partial": "cyan", "empty": "yellow"}.get(r.status, "red")
            held = [f for f in r.data_files if f.status == "identical"]
            out.print(
                f"[bold]{escape(str(r.mirror))}[/]: [{colour}]{r.status}[/], {len(held)} of {len(r.data_files)} expert data files "
                f"({human(r.bytes_held)} of {human(r.bytes_total)}, {r.records_held} of {r.records_total} experts)"
                + ("" if r.manifest_matches is not False else "; its manifest is of another container")
            )
            for f in r.files:
                if f.status == "identical":
                    out.print(f"  [green]identical[/]  {f.name}")
                elif f.status == "missing":
                    out.print(f"  [dim]missing    {f.name}[/]")
                else:
                    out.print(f"  [red]{f.status}[/] {escape(f.name)} {escape(f.detail)}")
    raise typer.Exit(0 if all(r.ok or r.status == "empty" for r in reports) else 1)


@mirror_app.command("stage")
def mirror_stage(
    primary: Path = typer.Argument(..., help="Primary container directory"),
    mirror_dir: Path = typer.Argument(..., help="Where the mirror goes (on another drive)"),
    hot_only: float | None = typer.Option(None, "--hot-only", help="Copy only the most-used expert files, up to GB"),
    usage_path: Path | None = typer.Option(None, "--usage", help="A .coli_usage file (default: the container's)"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
) -> None:
    """Copy a container (or its hottest expert files) to a mirror: verified, atomic per file, resumable."""
    from colibri_format.reader import load_manifest

    from .facts import load_usage
    from .mirror import file_usage_mass, plan_stage, stage_mirror

    try:
        mass = None
        if hot_only is not None:
            facts = load_facts(primary)
            usage, _ = load_usage(facts, usage_path)
            if usage is not None:
                mass = file_usage_mass(facts.records_per_file, usage.layers, usage.counts)
        budget = None if hot_only is None else int(hot_only * 1e9)
        names = plan_stage(primary, budget, mass)
        files = load_manifest(primary)["files"]
        total = sum(files[n]["size"] for n in names if n in files)
        start = time.perf_counter()
        with byte_progress(total, f"staging {mirror_dir.name}", progress) as adv:
            report = stage_mirror(primary, mirror_dir, hot_only_bytes=budget, file_mass=mass, progress=adv)
    except ColibriError as exc:
        fail(str(exc))
    seconds = time.perf_counter() - start
    out.print(
        f"staged {mirror_dir}: {len(report.copied)} files copied ({human(report.bytes_copied)}), "
        f"{len(report.skipped)} already present and verified; {human(report.bytes_planned)} planned"
        + (f"; {report.bytes_copied / seconds / 1e9:.2f} GB/s" if report.bytes_copied and seconds > 0 else "")
    )


# --- plan ------------------------------------------------------------------------------------------------------


@app.command()
def plan(
    path: Path = typer.Argument(..., help="Container directory"),
    ram: float = typer.Option(..., "--ram", help="RAM to use, GB (1e9 bytes)"),
    vram: float = typer.Option(0.0, "--vram", help="VRAM to use for experts, GB"),
    disk_gbps: float | None = typer.Option(None, "--disk-gbps", help="Disk read bandwidth, GB/s (default: measure)"),
    context: int = typer.Option(4096, "--context", help="Context length the KV cache is sized for"),
    pin_fraction: float = typer.Option(0.5, "--pin-fraction", help="Share of expert slots pinned to the hottest experts"),
    mtp: bool = typer.Option(False, "--mtp/--no-mtp", help="Keep the MTP head resident (speculative decoding)"),
    usage_path: Path | None = typer.Option(None, "--usage", help="A .coli_usage file (default: the container's)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """What stays resident, how many experts the caches hold, what gets pinned, and the predicted decode speed."""
    from .facts import load_usage
    from .plan import PlanInputs, make_plan, runtime_working_bytes
    from .scan import measure_read_bandwidth

    facts = load_facts(path)
    try:
        usage, why = load_usage(facts, usage_path)
    except ColibriError as exc:
        fail(str(exc))
    layers = facts.decoder_expert_layers
    counts = None
    if usage is not None:
        rows = [usage.layers.index(layer) for layer in layers if layer in usage.layers]
        if len(rows) == len(layers):
            counts = usage.counts[rows]
    bandwidth_source = "given"
    if disk_gbps is None:
        files = [facts.path / n for n in sorted(facts.records_per_file)]
        bw = measure_read_bandwidth(files, max_bytes=256 * 1024**2, jobs=2) if files else None
        disk_gbps = bw.gbps if bw else 0.0
        bandwidth_source = f"measured ({'cold' if bw and bw.cold else 'possibly cached'}, {human(bw.nbytes) if bw else 0})"
    dense = facts.bytes_by_role.get("resident", 0) + (facts.bytes_by_role.get("mtp", 0) if mtp else 0)
    p = make_plan(
        PlanInputs(
            dense_bytes=dense,
            bytes_per_expert=facts.bytes_per_expert,
            layers=layers,
            num_experts=facts.num_experts,
            top_k=facts.dims.top_k,
            kv_bytes_per_token=facts.dims.kv_bytes_per_token(),
            ram_bytes=int(ram * 1e9),
            vram_bytes=int(vram * 1e9),
            context=context,
            disk_bytes_per_s=disk_gbps * 1e9,
            pin_fraction=pin_fraction,
            working_bytes=runtime_working_bytes(facts.dims.top_k, facts.bytes_per_expert),
        ),
        counts,
    )
    if as_json:
        data = p.to_json()
        data["bandwidth_source"] = bandwidth_source
        data["usage"] = None if usage is None else str(usage.path)
        emit_json(data)
        return
    i = p.inputs
    out.print(
        f"[bold]plan for {escape(str(path))}[/] with {ram:g} GB RAM ({human(i.ram_bytes)})"
        + (f", {vram:g} GB VRAM ({human(i.vram_bytes)})" if i.vram_bytes else "")
    )
    out.print(f"  resident      dense weights {human(i.dense_bytes)}{' (with MTP)' if mtp else ''}"
              + ("" if p.dense_fits else " [red]does not fit[/]"))
    out.print(f"  reserved      KV cache {human(p.kv_bytes)} ({context} tokens), buffers {human(i.working_bytes)}, "
              f"OS {human(p.os_reserve_bytes)}")
    out.print(f"  expert cache  RAM {human(p.ram_expert_budget)} = {p.ram_slots} experts"
              + (f", VRAM {human(p.vram_expert_budget)} = {p.vram_slots} experts" if i.vram_bytes else "")
              + f" of {len(layers) * facts.num_experts} ({human(facts.bytes_per_expert)} each)")
    if p.all_experts_fit:
        out.print("                [green]every expert fits: after warm-up nothing is read from disk[/]")
    out.print(f"  pinned        {len(p.pinned)} hottest experts" + (f" ({p.vram_pinned} in VRAM)" if p.vram_pinned else "")
              + ("" if usage is not None else escape(f" (no usage history: {why})")))
    if p.pinned:
        out.print("                hottest: " + ", ".join(f"L{layer}/E{e}" for layer, e in p.pinned[:8])
                  + (" ..." if len(p.pinned) > 8 else ""))
    out.print(f"  LRU cache     {p.cache_per_layer} of {facts.num_experts} experts per layer, {len(layers)} layers")
    out.print(f"  hit rate      {p.hit_rate:.1%} predicted ({'from .coli_usage' if p.hit_rate_source == 'usage' else 'uniform routing assumed'})")
    out.print(f"  per token     {p.experts_per_token} experts activated, {human(p.missed_bytes_per_token)} read from disk")
    out.print(f"  disk          {disk_gbps:.2f} GB/s {bandwidth_source}")
    if p.tokens_per_s is None:
        out.print("  [green]decode        not disk-bound (every activated expert is cached)[/]")
    else:
        out.print(f"  [bold]decode        ~{p.tokens_per_s:.2f} tok/s predicted[/] (disk-bound estimate)")
    for w in p.warnings:
        out.print(f"  [yellow]warning[/] {escape(w)}")


# --- doctor ------------------------------------------------------------------------------------------------------


@app.command()
def doctor(
    path: Path = typer.Argument(..., help="Container directory"),
    mirrors: list[Path] = typer.Option([], "--mirror", help="Mirror directories to measure too"),
    context: int = typer.Option(4096, "--context"),
    probe_mb: int = typer.Option(256, "--probe-mb", help="MB read per drive to measure bandwidth"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Read-only readiness of this machine for a container. Exit 0 ready, 1 not."""
    from .doctor import ready, run_doctor

    checks = run_doctor(path, mirrors=mirrors, context=context, probe_bytes=probe_mb * 1024**2)
    ok = ready(checks)
    if as_json:
        emit_json({"ready": ok, "checks": [c.to_json() for c in checks]})
        raise typer.Exit(0 if ok else 1)
    marks = {"ok": "[green]ok  [/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}
    for c in checks:
        out.print(f"{marks[c.status]} {c.name:10} {escape(c.message)}")
        if c.advice and c.status != "ok":
            out.print(f"     {'':10} -> {escape(c.advice)}")
    out.print("[green]ready[/]" if ok else "[red]not ready[/]")
    raise typer.Exit(0 if ok else 1)


# --- usage ------------------------------------------------------------------------------------------------------


@app.command()
def usage(
    path: Path = typer.Argument(..., help="Container directory"),
    png: Path | None = typer.Option(None, "--png", help="Write a layer x expert heatmap PNG here"),
    top: int = typer.Option(20, "--top", help="Rows in the table of hottest experts"),
    usage_path: Path | None = typer.Option(None, "--usage", help="A .coli_usage file (default: the container's)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Routing heat of every expert from .coli_usage: a heatmap picture and the hottest experts."""
    from .facts import load_usage
    from .heatmap import concentration, hottest, write_heatmap

    facts = load_facts(path)
    try:
        u, why = load_usage(facts, usage_path)
    except ColibriError as exc:
        fail(str(exc))
    if u is None:
        fail(f"no usage history: {why}")
    hot = hottest(u.counts, u.layers, top)
    conc = concentration(u.counts)
    if png is not None:
        write_heatmap(png, u.counts)
    if as_json:
        emit_json(
            {
                "usage": str(u.path),
                "turns": u.turns,
                "decay": u.decay,
                "total": u.total,
                "concentration": {str(k): v for k, v in conc.items()},
                "hottest": [h.__dict__ for h in hot],
                "png": str(png) if png else None,
            }
        )
        return
    out.print(f"[bold]{escape(str(u.path))}[/]: {u.turns} turns, decay {u.decay}, {len(u.layers)} layers x {facts.num_experts} experts")
    out.print("  hottest " + ", ".join(f"{int(f * 100)}% of experts carry {v:.1%}" for f, v in conc.items()))
    table = Table("rank", "layer", "expert", "count", "of layer", "of all")
    for rank, h in enumerate(hot, 1):
        table.add_row(str(rank), str(h.layer), str(h.expert), f"{h.count:.1f}", f"{h.layer_share:.1%}", f"{h.total_share:.2%}")
    out.print(table)
    if png is not None:
        out.print(f"heatmap: {png} (rows = layers {u.layers[0]}..{u.layers[-1]}, columns = experts)")


@app.command()
def replay(
    trace: Path = typer.Argument(..., help="A routing trace written by colibri-run --trace FILE"),
    capacity: float = typer.Option(0.25, "--capacity", help="Cache capacity per layer, as a fraction of its experts"),
    learn: float = typer.Option(0.5, "--learn", help="Fraction of the trace pinning learns from (judged on the rest)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Replay a routing trace through LRU, LRU + pinning, LRU + pinning + prefetch and Belady's optimum."""
    from colibri_runtime.trace import RoutingTrace

    from .replay import replay as run_replay

    try:
        t = RoutingTrace.load(trace)
    except ColibriError as exc:
        fail(str(exc))
    results = run_replay(t, capacity_fraction=capacity, learn_fraction=learn)
    belady = next(r for r in results if r.policy == "belady")
    if as_json:
        emit_json({"tokens": t.tokens, "layers": t.layers, "num_experts": t.num_experts, "capacity": belady.capacity,
                   "policies": {r.policy: {"hit_rate": r.hit_rate, "accesses": r.accesses} for r in results}})
        return
    out.print(f"{trace}: {t.tokens} tokens, {len(t.layers)} MoE layers x {t.num_experts} experts, top-{t.top_k}; "
              f"capacity {belady.capacity} experts per layer ({capacity:.0%}), pinning learned on the first {learn:.0%}")
    table = Table("policy", "hit rate", "x Belady")
    for r in results:
        ratio = r.hit_rate / belady.hit_rate if belady.hit_rate else 0.0
        table.add_row(r.policy, f"{100 * r.hit_rate:.1f}%", f"{ratio:.2f}")
    out.print(table)


@app.command()
def version() -> None:
    """Print the version."""
    from colibri_format import __version__

    typer.echo(__version__)


def main() -> None:
    try:
        app()
    except ColibriError as exc:  # anything a command did not catch itself
        err.print(f"error: {exc}")
        sys.exit(1)
