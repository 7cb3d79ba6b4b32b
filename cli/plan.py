"""`edgespec plan`: where a target and its drafter would go under a memory budget, without loading."""
from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from edgespec.memory import planner
from edgespec.cli import app
from edgespec.cli import common as c
from edgespec.cli.common import MODEL, print_json
from edgespec.errors import InvalidRequest, ModelNotFound
from edgespec.files.store import ModelStore
from edgespec.units import parse_bytes
from dataclasses import replace

def _drafter_for(kind: str, draft_model: str | None, target_fp: planner.ModelFootprint, target_gguf,
                 store: ModelStore) -> tuple[planner.ModelFootprint | None, bool, list[str], object]:
    """(drafter footprint or None, whether the suffix drafter runs, notes, its path) for a --draft value."""
    from edgespec.drafters import DEFAULT_DRAFT_MODELS, KINDS, drafter_model_path, kind_of
    from edgespec.files.modelfile import model_file
    from edgespec.files.vocab import check_compatible

    declared = kind_of(kind)
    notes: list[str] = []
    try:
        path = drafter_model_path(kind, draft_model, target_fp.tokenizer_fingerprint, store)
    except (InvalidRequest, ModelNotFound) as exc:
        if declared.model != "optional" or draft_model is not None or kind not in KINDS:
            raise
        notes.append(f"no drafter model ({exc}): suffix drafter only")
        path = None
    if path is None:
        if declared.model == "optional" and draft_model is None:
            notes.append("no default drafter model is pulled for this target: suffix drafter only")
        return None, declared.suffix, notes, None
    mf = model_file(path)
    check_compatible(target_gguf, mf.gguf)
    label = draft_model or (kind if kind not in KINDS else DEFAULT_DRAFT_MODELS.get(target_fp.tokenizer_fingerprint, path.stem))
    return replace(mf.footprint, name=label), declared.suffix, notes, path


def _onnx_drafter_for(kind: str, draft_model: str | None, target_fp: planner.ModelFootprint, target_gguf,
                      store: ModelStore, provider: str, bits: str, notes: list[str]):
    """The ONNX drafter's footprint for `--draft onnx` (None for other kinds), its vocabulary checked."""
    from edgespec.drafters import check_onnx_options, kind_of
    from edgespec.files.modelfile import model_file
    from edgespec.files.vocab import check_compatible
    from edgespec.memory.budget import onnx_drafter_footprint

    check_onnx_options(provider, bits)
    if not kind_of(kind).onnx_model:
        return None
    fp = onnx_drafter_footprint(draft_model, target_fp.tokenizer_fingerprint, store, provider, bits)
    if fp is None:
        notes.append("the default drafter model is not pulled: the onnx drafter is not counted")
        return None
    check_compatible(target_gguf, model_file(store.resolve(draft_model or fp.name)).gguf)
    if fp.provider != provider:
        notes.append(f"onnx provider {provider} is not in this onnxruntime: planned on the CPU")
    return fp


@app.command()
def plan(
    model: str = MODEL,
    draft: str = typer.Option("auto", "--draft", "-d",
                              help="none | suffix | model | hybrid | auto | onnx, or a drafter model name/path."),
    draft_model: str = typer.Option(None, "--draft-model", help="Drafter model for model/hybrid/auto."),
    ram_budget: str = typer.Option(None, "--ram-budget",
                                   help="RAM to plan for: 2GiB, 2GB, 2048M or bytes (default: available - margin)."),
    vram_budget: str = typer.Option(None, "--vram-budget",
                                    help="GPU memory to plan for (default: free VRAM - margin)."),
    ctx: int = typer.Option(None, "--ctx", "-c", min=16,
                            help="Context size in tokens (default: 4096, reduced to fit)."),
    kv_type: str = typer.Option(None, "--kv-type", help="Force the KV cache type: f16 | q8_0 | q4_0."),
    draft_max: Optional[int] = c.DRAFT_MAX,
    draft_tree: Optional[bool] = c.DRAFT_TREE,
    mlock: bool = typer.Option(False, "--mlock", help="Lock the weights in RAM if the system allows it."),
    threads: int = typer.Option(None, "--threads", "-t", min=1, help="CPU threads (default: physical cores)."),
    onnx_provider: str = c.ONNX_PROVIDER,
    onnx_bits: str = c.ONNX_BITS,
    placement: str = typer.Option(None, "--placement",
                                  help="Force where target and drafter run: gpu | offload | draft-gpu | overlap | cpu "
                                       "(default: the planner's choice)."),
    exact: bool = c.EXACT,
    flash_attn: Optional[bool] = c.FLASH_ATTN,
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON object."),
) -> None:
    """Plan memory placement (GPU layers, drafter, KV cache, context, mmap, threads) without loading."""
    from edgespec.files.modelfile import model_file

    ram = parse_bytes(ram_budget) if ram_budget is not None else None
    vram = parse_bytes(vram_budget) if vram_budget is not None else None
    if kv_type is not None and kv_type not in planner.KV_CACHE_TYPES:
        raise InvalidRequest(f"--kv-type must be one of {', '.join(planner.KV_CACHE_TYPES)}, got {kv_type!r}")
    store = ModelStore()
    path = store.resolve(model)
    mf = model_file(path)
    target = replace(mf.footprint, name=model)
    drafter, suffix, notes, drafter_path = _drafter_for(draft, draft_model, target, mf.gguf, store)
    onnx_fp = _onnx_drafter_for(draft, draft_model, target, mf.gguf, store, onnx_provider, onnx_bits, notes)
    kw = dict(suffix=suffix, draft_max=draft_max, draft_tree=draft_tree, long_drafts=draft == "auto", mlock=mlock,
              kv_type=kv_type, threads=threads, external_drafter=onnx_fp, flash_attn=flash_attn)
    if exact:
        from edgespec.engine import EngineConfig
        from edgespec.llama import invariant
        from edgespec.memory.budget import EXACT_PLAN

        if kv_type not in (None, invariant.KV_TYPE):
            raise InvalidRequest(f"--exact plans a {invariant.KV_TYPE} KV cache (its attention kernel does not "
                                 f"depend on the batch); drop --kv-type {kv_type}")

        EngineConfig(exact=True, draft_tree=draft_tree, placement=placement, flash_attn=flash_attn)  # refuses what exact mode cannot keep
        invariant.enable()  # calibration keys name the kernels
        kw.update(EXACT_PLAN, draft_tree=False)
    m = planner.machine()
    p = planner.make_plan(target, drafter, ram, vram, ctx, machine_info=m, placement=placement, **kw)
    if draft == "auto" and drafter is not None and p.drafter_placement != "none":
        from edgespec.memory.budget import auto_skips_drafter

        why = auto_skips_drafter(p, str(path), str(drafter_path), store, p.draft_max, p.draft_tree)
        if why:
            notes.append(why)
            drafter = None
            p = planner.make_plan(target, drafter, ram, vram, ctx, machine_info=m, placement=placement, **kw)
    p.warnings[:0] = notes
    others = _placements(target, drafter, ram, vram, ctx, m, kw)
    if as_json:
        print_json({**p.to_dict(), "placements": others})
        return
    _print(p)
    _print_placements(others, p.placement)


def _placements(target, drafter, ram, vram, ctx, m: planner.MachineInfo, kw) -> dict[str, dict]:
    """What each placement mode would do with these budgets on machine ``m``, or why it cannot."""
    from edgespec.errors import BudgetExceeded
    from edgespec.memory import placements

    out = {}
    for name in placements.NAMES:
        try:
            q = planner.make_plan(target, drafter, ram, vram, ctx, machine_info=m, placement=name, **kw)
        except placements.PlacementUnavailable:
            out[name] = {"available": False, "why": "needs a GPU: " + placements.unavailable(m)[name]}
            continue
        except BudgetExceeded as exc:
            out[name] = {"available": False, "why": str(exc)}
            continue
        out[name] = {"available": True, "n_gpu_layers": q.n_gpu_layers, "drafter": q.drafter_placement,
                     "ram_bytes": q.ram_bytes, "vram_bytes": q.vram_bytes, "kv_type": q.kv_type,
                     "n_ctx": q.n_ctx, "weights": q.weights_mode, "draft_max": q.draft_max,
                     "draft_tree": q.draft_tree}
    return out


def _print_placements(others: dict[str, dict], chosen: str) -> None:
    fb = planner.fmt_bytes
    out = Console(highlight=False)
    t = Table(title="Placements with these budgets", title_justify="left")
    for col in ("placement", "target GPU layers", "drafter", "RAM", "VRAM", "notes"):
        t.add_column(col)
    no_gpu = {o["why"] for o in others.values() if o.get("why", "").startswith("needs a GPU")}
    for name, o in others.items():
        mark = f"[bold]{name}[/bold] (chosen)" if name == chosen else name
        if not o["available"]:
            t.add_row(mark, "-", "-", "-", "-", "needs a GPU (below)" if o["why"] in no_gpu else o["why"])
            continue
        t.add_row(mark, str(o["n_gpu_layers"]), o["drafter"], fb(o["ram_bytes"]), fb(o["vram_bytes"]),
                  f"{o['kv_type']} cache, context {o['n_ctx']}, {o['weights']} weights, drafts up to "
                  f"{o['draft_max']}" + (", trees" if o["draft_tree"] else ""))
    out.print(t)
    for why in sorted(no_gpu):
        out.print(f"[yellow]note:[/yellow] {why}")


def _print(p: planner.Plan) -> None:
    fb = planner.fmt_bytes
    out = Console(highlight=False)
    head = f"Plan for {p.target}" + (f" + drafter {p.drafter}" if p.drafter else "")
    out.print(f"[bold]{head}[/bold]: RAM {fb(p.ram_bytes)} of {fb(p.ram_budget)}"
              + (f", VRAM {fb(p.vram_bytes)} of {fb(p.vram_budget)}" if p.vram_bytes else ""))
    t = Table(title="What goes where", title_justify="left")
    t.add_column("part")
    t.add_column("where")
    t.add_column("bytes", justify="right")
    t.add_column("why")
    for part in p.parts:
        t.add_row(part.component, part.where, fb(part.bytes), part.note)
    t.add_row("[bold]total resident[/bold]", "RAM", f"[bold]{fb(p.ram_bytes)}[/bold]", "")
    out.print(t)
    d = Table(title="Decisions", title_justify="left")
    d.add_column("setting")
    d.add_column("value")
    d.add_column("why")
    for x in p.decisions:
        d.add_row(x.name, str(x.value), x.why)
    out.print(d)
    for w in p.warnings:
        out.print(f"[yellow]note:[/yellow] {w}")
