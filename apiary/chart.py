"""The demo's PNG: latency distribution by tier, and the edge/cloud split over time."""
from __future__ import annotations

from pathlib import Path


def save_chart(latencies: dict[str, list[float]], timeline: list[tuple[float, str]], start: float,
               path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"edge": "tab:green", "cloud": "tab:blue"}
    for tier, vals in latencies.items():
        if vals:
            ax1.hist(np.asarray(vals) / 1000.0, bins=30, alpha=0.6, label=f"{tier} (n={len(vals)})", color=colors[tier])
    ax1.set_xlabel("event → final answer (s)")
    ax1.set_ylabel("answers")
    ax1.set_title("Latency by answering tier")
    ax1.legend()

    if timeline:
        t = np.asarray([ts - start for ts, _ in timeline])
        for tier in ("edge", "cloud"):
            mask = np.asarray([tr == tier for _, tr in timeline])
            ax2.plot(np.sort(t[mask]), np.arange(1, mask.sum() + 1), label=tier, color=colors[tier])
    ax2.set_xlabel("time since start (s)")
    ax2.set_ylabel("answers (cumulative)")
    ax2.set_title("Edge / cloud split over time")
    ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
