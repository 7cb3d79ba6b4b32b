"""`edgespec bench`: plain decoding and each configuration side by side, same prompts, one run."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from edgespec.bench.plot import plot_speedups
from edgespec.bench.report import markdown as to_markdown
from edgespec.bench.prompts import load_prompts, load_suite, select
from edgespec.bench.peers import NATIVE_PLAIN
from edgespec.bench.runner import TURNS, BenchSettings, run_bench
from edgespec.bench.summary import OVERALL, has_native_plain
from edgespec.cli import app
from edgespec.cli import common as c
from edgespec.errors import InvalidRequest


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render_table(summary: dict) -> Table:
    t = Table(title="tokens/s | speedup over plain (same run) | mean emitted tokens per step")
    t.add_column("config")
    categories = list(next(iter(summary.values())).keys())
    for cat in categories:
        t.add_column(cat, justify="right")
    for cfg, cells in summary.items():
        row = [cfg]
        for cat in categories:
            cell = cells.get(cat)
            row.append("-" if cell is None else
                       f"{_fmt(cell['tokens_per_s'], '.1f')} | {_fmt(cell['speedup'], '.2f')}x | "
                       f"{_fmt(cell['mean_emitted'], '.2f')}")
        t.add_row(*row)
    return t


def render_native_table(summary: dict) -> Table:
    """Each configuration's speedup over native plain decoding, same run."""
    t = Table(title=f"speedup over native plain ({NATIVE_PLAIN}, same run)")
    t.add_column("config")
    categories = list(next(iter(summary.values())).keys())
    for cat in categories:
        t.add_column(cat, justify="right")
    for cfg, cells in summary.items():
        t.add_row(cfg, *("-" if cells.get(cat) is None else f"{_fmt(cells[cat]['speedup_native'], '.2f')}x"
                         for cat in categories))
    return t


@app.command()
def bench(
    suite: Optional[str] = typer.Option(None, "--suite", help="specbench | code-edit | code-edit-validation | code-edit-test"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL prompt file (id, category, turns|prompt)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Prompts per category (deterministic)."),
    split: str = typer.Option("tune", "--split",
                              help="tune: the --limit prompts tuning used | validate: those halfway "
                                   "between them | test: those a quarter of the way | test2: three quarters "
                                   "| test3: an eighth | test4: three eighths (all disjoint)."),
    configs: str = typer.Option("plain,suffix", "--configs",
                                help="Comma list: plain, none, suffix, model, model-tree, hybrid, auto, onnx, peer:...; "
                                     "X+recheck: X re-checking near-ties at --recheck-gap."),
    model: str = c.MODEL,
    draft_model: Optional[str] = c.DRAFT_MODEL,
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1),
    temperature: float = typer.Option(0.0, "--temperature", "--temp", min=0.0),
    seed: int = typer.Option(0, "--seed", "-s"),
    repeat: int = typer.Option(1, "--repeat", min=1, help="Repeat the whole run and report the spread."),
    draft_max: Optional[int] = c.DRAFT_MAX,
    draft_tree: Optional[bool] = c.DRAFT_TREE,
    onnx_provider: str = c.ONNX_PROVIDER,
    onnx_bits: str = c.ONNX_BITS,
    recheck_gap: float = typer.Option(0.0, "--recheck-gap", min=0.0,
                                      help="Greedy: the top-2 logit gap below which configurations named "
                                           "X+recheck (e.g. auto+recheck) re-decode a verified position alone."),
    turns: str = typer.Option("first", "--turns",
                              help=f"{' | '.join(TURNS)}: all runs each conversation to its end, every "
                                   "later turn after plain decoding's answers."),
    share_prefill: bool = typer.Option(False, "--share-prefill",
                                       help="Evaluate each prompt once for all edgespec configs."),
    ram_budget: Optional[str] = c.RAM_BUDGET,
    vram_budget: Optional[str] = c.VRAM_BUDGET,
    placement: Optional[str] = c.PLACEMENT,
    exact: bool = c.EXACT,
    greedy_on_backend: bool = c.GREEDY_ON_BACKEND,
    flash_attn: Optional[bool] = typer.Option(None, "--flash-attn/--no-flash-attn",
                                              help="The target's attention kernel in every configuration and the "
                                                   "peers (default: the engine's, off on the CPU; the peers', on); "
                                                   "the draft peer's drafter gets it too, edgespec's keeps its own."),
    ctx: int = c.CTX,
    threads: Optional[int] = c.THREADS,
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write every record and the summary here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Draw speedup per category (needs matplotlib)."),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Write the table as Markdown here."),
) -> None:
    """Benchmark plain decoding against speculative configurations and peers."""
    if (suite is None) == (prompts is None):
        raise InvalidRequest("pass exactly one of --suite or --prompts")
    # Bad options are refused here, before the target loads.
    engine = c.engine_config(model=model, draft_model=draft_model, ctx=ctx, threads=threads, draft_max=draft_max,
                             draft_tree=draft_tree, recheck_gap=recheck_gap, onnx_provider=onnx_provider,
                             onnx_bits=onnx_bits, ram_budget=ram_budget, vram_budget=vram_budget,
                             placement=placement, exact=exact, flash_attn=flash_attn,
                             greedy_on_backend=greedy_on_backend)
    items = select(load_suite(suite) if suite else load_prompts(prompts), limit, split)
    settings = BenchSettings(engine, max_tokens=max_tokens, temperature=temperature, seed=seed, repeats=repeat,
                             share_prefill=share_prefill, turns=turns)
    err = Console(stderr=True, highlight=False)
    result = run_bench(items, [x.strip() for x in configs.split(",") if x.strip()], settings,
                       lambda n, total, pid, config: err.print(f"[{n + 1}/{total}] {pid} {config}", end="\r"))
    _report(result, err, repeat, json_out, plot, markdown, suite or str(prompts))


def _report(result, err: Console, repeat: int, json_out: Optional[Path], plot: Optional[Path],
            markdown: Optional[Path], title: str) -> None:
    """The tables on stdout, the spread over repeats on stderr, and the files asked for."""
    summary = result.summary
    out = Console(highlight=False)
    out.print(render_table(summary))
    if has_native_plain(summary):
        out.print(render_native_table(summary))
    for cfg, cells in summary.items():
        o = cells[OVERALL]
        if "speedup_min" in o:
            err.print(f"{cfg}: overall speedup {o['speedup']:.2f}x over {repeat} repeats "
                      f"(min {o['speedup_min']:.2f}x, max {o['speedup_max']:.2f}x)")
    if json_out:
        json_out.write_text(json.dumps(result.to_dict(), indent=1))
        err.print(f"wrote {json_out}")
    if plot:
        err.print(f"wrote {plot_speedups(summary, plot, title=title)}")
    if markdown:
        command = "edgespec " + " ".join(sys.argv[1:])
        markdown.write_text(to_markdown(result.to_dict(), title, command))
        err.print(f"wrote {markdown}")
