"""Speedup per category per configuration as a grouped bar chart (matplotlib, optional)."""
from __future__ import annotations

from pathlib import Path

from edgespec.bench.summary import OVERALL, PLAIN
from edgespec.errors import InvalidRequest


def plot_speedups(summary: dict, path: str | Path, title: str = "") -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise InvalidRequest("--plot needs matplotlib: pip install 'edgespec[plot]'") from exc
    configs = [c for c in summary if c != PLAIN]
    categories = [c for c in summary[PLAIN] if c != OVERALL] + [OVERALL]
    width = 0.8 / max(len(configs), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(categories)), 4))
    for k, cfg in enumerate(configs):
        values = [(summary[cfg].get(cat) or {}).get("speedup") or 0.0 for cat in categories]
        ax.bar([i + k * width for i in range(len(categories))], values, width, label=cfg)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(categories))])
    ax.set_xticklabels(categories, rotation=20)
    ax.set_ylabel("speedup over plain (same run)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
