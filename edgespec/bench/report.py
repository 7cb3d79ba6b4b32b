"""Markdown tables of a benchmark result, for benchmarks/RESULTS.md."""
from __future__ import annotations

from edgespec.bench.peers import NATIVE_PLAIN
from edgespec.bench.summary import IN_LAYOUT, OVERALL, PLAIN, Record, has_native_plain, summarize


def _cell(c: dict | None) -> str:
    if c is None:
        return "-"
    speed = f"{c['tokens_per_s']:.1f}"
    ratio = "-" if c.get("speedup") is None else f"{c['speedup']:.2f}x"
    emitted = "" if c.get("mean_emitted") is None else f" ({c['mean_emitted']:.2f})"
    return f"{ratio} · {speed}{emitted}"


def _ratio_cell(c: dict | None, key: str) -> str:
    return "-" if c is None or c.get(key) is None else f"{c[key]:.2f}x"


def baseline_line(settings: dict) -> str:
    """What `plain` was in this run (settings["baseline"], edgespec.bench.runner.baseline)."""
    b = settings.get("baseline")
    if not b:
        return "Plain: plain decoding of the same load."
    where = f"{b['n_gpu_layers']} target layers on the GPU" + (f" ({b['placement']} placement)" if b["placement"] else "")
    if not b["separate_load"]:
        return f"Plain: the best plain decoding at these budgets, in the same load ({where})."
    return (f"Plain: the best plain decoding at these budgets, the target alone with {where}, run first on its own "
            f"load; `{IN_LAYOUT}` is plain decoding in the speculative layout ({b['layout_n_gpu_layers']} target "
            "layers on the GPU), a secondary baseline.")


def markdown(result: dict, title: str, command: str) -> str:
    """One section: the command, the machine, and speedup · tok/s (mean emitted) per category."""
    records = [Record(**{k: v for k, v in r.items() if k != "tokens_per_s"}) for r in result["records"]]
    summary = summarize(records)
    cats = [c for c in summary[PLAIN] if c != OVERALL] + [OVERALL]
    m = result["machine"]
    lines = [f"### {title}", "", f"`{command}`", "",
             f"Machine: {m['cpu']}, {m['physical_cores']} cores, {m['threads']} threads, "
             f"llama-cpp-python {m['llama_cpp_python']}, edgespec {m['edgespec']} "
             f"(commit {str(m.get('git_commit'))[:10]}).", "",
             "Each cell: speedup over plain in the same run · tokens/s (mean emitted tokens per step).",
             baseline_line(result.get("settings", {})), "",
             "| config | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for cfg, cells in summary.items():
        lines.append(f"| {cfg} | " + " | ".join(_cell(cells.get(c)) for c in cats) + " |")
    if has_native_plain(summary):
        lines += ["", f"Speedup over native plain decoding ({NATIVE_PLAIN}) in the same run:", "",
                  "| config | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
        for cfg, cells in summary.items():
            lines.append(f"| {cfg} | " + " | ".join(_ratio_cell(cells.get(c), "speedup_native") for c in cats) + " |")
    if IN_LAYOUT in summary:
        lines += ["", f"Secondary: speedup over plain decoding in the speculative layout ({IN_LAYOUT}):", "",
                  "| config | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
        for cfg, cells in summary.items():
            lines.append(f"| {cfg} | " + " | ".join(_ratio_cell(cells.get(c), "speedup_in_layout") for c in cats) + " |")
    same = [r for r in records if r.same_as_plain is not None]
    if same:
        against = f" in the same layout ({IN_LAYOUT}; {IN_LAYOUT} against {PLAIN})" if IN_LAYOUT in summary else ""
        lines += ["", f"Greedy output identical to plain decoding{against}: " + ", ".join(
            f"{cfg} {sum(r.same_as_plain for r in same if r.config == cfg)}/"
            f"{sum(1 for r in same if r.config == cfg)}" for cfg in dict.fromkeys(r.config for r in same)) + "."]
    rechecked = [r for r in records if r.rechecks]
    if rechecked:
        lines += ["", "Greedy near-tie re-checks (positions re-decoded alone / tokens): " + ", ".join(
            f"{cfg} {sum(r.rechecks for r in records if r.config == cfg)}/"
            f"{sum(r.new_tokens for r in records if r.config == cfg)}"
            for cfg in dict.fromkeys(r.config for r in rechecked)) + "."]
    return "\n".join(lines) + "\n"
