"""`edgespec plan`: what `edgespec run` would load with the same options, without loading it."""
from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from edgespec.cli import app
from edgespec.cli import common as c
from edgespec.cli.common import print_json
from edgespec.files.store import ModelStore
from edgespec.load import LoadPlan, each_placement, resolve
from edgespec.memory.machine import machine
from edgespec.units import format_bytes as fb


@app.command()
def plan(
    model: str = c.MODEL,
    draft: str = c.DRAFT,
    draft_model: Optional[str] = c.DRAFT_MODEL,
    ram_budget: Optional[str] = c.RAM_BUDGET,
    vram_budget: Optional[str] = c.VRAM_BUDGET,
    placement: Optional[str] = c.PLACEMENT,
    ctx: int = c.CTX,
    n_gpu_layers: int = c.GPU_LAYERS,
    kv_type: Optional[str] = c.KV_TYPE,
    draft_max: Optional[int] = c.DRAFT_MAX,
    draft_tree: Optional[bool] = c.DRAFT_TREE,
    mlock: bool = typer.Option(False, "--mlock", help="Lock the weights in RAM if the system allows it."),
    threads: Optional[int] = c.THREADS,
    onnx_provider: str = c.ONNX_PROVIDER,
    onnx_bits: str = c.ONNX_BITS,
    exact: bool = c.EXACT,
    flash_attn: Optional[bool] = c.FLASH_ATTN,
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON object."),
) -> None:
    """Show what `run` with these options loads (GPU layers, drafter, KV cache, context), without loading."""
    config = c.engine_config(model=model, ctx=ctx, threads=threads, n_gpu_layers=n_gpu_layers, draft=draft,
                             draft_max=draft_max, draft_tree=draft_tree, draft_model=draft_model,
                             ram_budget=ram_budget, vram_budget=vram_budget, placement=placement,
                             onnx_provider=onnx_provider, onnx_bits=onnx_bits, exact=exact,
                             flash_attn=flash_attn, kv_type=kv_type, use_mlock=mlock)
    store, m = ModelStore(), machine()
    chosen = resolve(config, m, store)
    others = each_placement(config, m, store)
    if as_json:
        print_json({**chosen.to_dict(), "placements": {k: _summary(v) for k, v in others.items()}})
        return
    out = Console(highlight=False)
    if chosen.plan is not None:
        _print_plan(out, chosen)
    else:
        _print_as_asked(out, chosen)
    _print_placements(out, others, chosen.mode.name if chosen.mode else None)


def _summary(p: LoadPlan | str) -> dict:
    """One placement mode's plan in a line of JSON, or why it cannot run."""
    if isinstance(p, str):
        return {"available": False, "why": p}
    q = p.plan
    return {"available": True, "n_gpu_layers": q.n_gpu_layers, "drafter": q.drafter_placement,
            "ram_bytes": q.ram_bytes, "vram_bytes": q.vram_bytes, "kv_type": q.kv_type, "n_ctx": q.n_ctx,
            "weights": q.weights_mode, "draft_max": q.draft_max, "draft_tree": q.draft_tree,
            "expected_tokens_per_s": q.expected_tokens_per_s, "plain_tokens_per_s": q.plain_tokens_per_s}


def _print_placements(out: Console, others: dict[str, LoadPlan | str], chosen: str | None) -> None:
    t = Table(title="The planner's choice in each placement (--placement NAME), with these budgets",
              title_justify="left")
    for col in ("placement", "target GPU layers", "drafter", "RAM", "VRAM", "notes"):
        t.add_column(col)
    summaries = {name: _summary(p) for name, p in others.items()}
    no_gpu = {o["why"] for o in summaries.values() if o.get("why", "").startswith("needs a GPU")}
    for name, o in summaries.items():
        mark = f"[bold]{name}[/bold] (chosen)" if name == chosen else name
        if not o["available"]:
            t.add_row(mark, "-", "-", "-", "-", "needs a GPU (below)" if o["why"] in no_gpu else o["why"])
            continue
        speed = "" if o["plain_tokens_per_s"] is None else \
            f"; ~{o['expected_tokens_per_s'] / o['plain_tokens_per_s']:.2f}x plain at this budget (estimate)"
        t.add_row(mark, str(o["n_gpu_layers"]), o["drafter"], fb(o["ram_bytes"]), fb(o["vram_bytes"]),
                  f"{o['kv_type']} cache, context {o['n_ctx']}, {o['weights']} weights, drafts up to "
                  f"{o['draft_max']}" + (", trees" if o["draft_tree"] else "") + speed)
    out.print(t)
    for why in sorted(no_gpu):
        out.print(f"[yellow]note:[/yellow] {why}")


def _print_as_asked(out: Console, p: LoadPlan) -> None:
    """A load without a budget or a placement: the settings `run` passes to llama.cpp."""
    m, x = p.model, p.context
    out.print(f"[bold]Load for {p.config.model}[/bold]: as asked (no --ram-budget, --vram-budget or "
              "--placement, so the planner does not place it)")
    t = Table(title="Settings", title_justify="left")
    t.add_column("setting")
    t.add_column("value")
    rows = [("target GPU layers", m.n_gpu_layers), ("context", x.n_ctx), ("KV cache", x.kv_type),
            ("flash attention", {None: "llama.cpp's choice", True: "on", False: "off"}[x.flash_attn]),
            ("weights", "mapped" if m.use_mmap else "read into memory"), ("repacked for the CPU", m.repack),
            ("drafter", p.draft or "none (plain decoding)"),
            ("draft shape", f"up to {p.shape.draft_max} tokens" + (", trees" if p.shape.tree else ", chains"))]
    for name, value in rows:
        t.add_row(name, str(value))
    out.print(t)
    for note in p.notes:
        out.print(f"[yellow]note:[/yellow] {note}")


def _print_plan(out: Console, lp: LoadPlan) -> None:
    """The planner's plan: its parts, where they go, and why each setting was chosen."""
    p = lp.plan
    head = f"Plan for {p.target}" + (f" + drafter {p.drafter}" if p.drafter else "")
    out.print(f"[bold]{head}[/bold]: RAM {fb(p.ram_bytes)} of {fb(p.ram_budget)}"
              + (f", VRAM {fb(p.vram_bytes)} of {fb(p.vram_budget)}" if p.vram_bytes else ""))
    t = Table(title="What goes where", title_justify="left")
    for col in ("part", "where", "bytes", "why"):
        t.add_column(col, justify="right" if col == "bytes" else "left")
    for part in p.parts:
        t.add_row(part.component, part.where, fb(part.bytes), part.note)
    t.add_row("[bold]total resident[/bold]", "RAM", f"[bold]{fb(p.ram_bytes)}[/bold]", "")
    out.print(t)
    d = Table(title="Decisions", title_justify="left")
    for col in ("setting", "value", "why"):
        d.add_column(col)
    for x in p.decisions:
        d.add_row(x.name, str(x.value), x.why)
    out.print(d)
    if p.plain_tokens_per_s is not None:
        out.print(f"Expected speed (estimate, edgespec.memory.speed): ~{p.expected_tokens_per_s:.0f} tok/s; plain "
                  f"decoding at these budgets (the target alone, {p.plain_n_gpu_layers} layers on the GPU): "
                  f"~{p.plain_tokens_per_s:.0f} tok/s")
    for w in p.warnings:
        out.print(f"[yellow]note:[/yellow] {w}")
