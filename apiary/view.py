"""The demo's live terminal view and final summary, rendered from an observer snapshot."""
from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def render(snap: dict[str, Any], engine: dict[str, Any] | None = None, title: str = "Apiary Mesh demo") -> Panel:
    flow = Table.grid(padding=(0, 2))
    flow.add_row("elapsed", f"{snap['elapsed_s']:.0f} s", "events", str(snap["events"]),
                 "events/s (10 s)", f"{snap['events_per_s_10s']:.1f}")
    tiers = snap["answers_by_tier"]
    flow.add_row("needing an answer", str(snap["events_needing_answer"]), "answered", str(snap["answered"]),
                 "edge / cloud", f"{tiers.get('edge', 0)} / {tiers.get('cloud', 0)}")
    flow.add_row("escalations", str(snap["escalations"]), "anomalies caught / injected",
                 f"{snap['anomalies_caught']} / {snap['anomalies_injected']}", "double answers",
                 str(snap["double_answers"]))

    lat = Table(title="event → final answer (ms)", expand=False)
    for c in ("tier", "n", "p50", "p99"):
        lat.add_column(c)
    for tier, v in snap["latency_ms"].items():
        lat.add_row(tier, str(v["n"]), _ms(v["p50"]), _ms(v["p99"]))

    reasons = Table(title="escalation reasons")
    reasons.add_column("reason")
    reasons.add_column("count")
    for r, n in sorted(snap["escalation_reasons"].items(), key=lambda kv: -kv[1]):
        reasons.add_row(r, str(n))

    devices = Table(title="devices")
    for c in ("device", "online", "battery", "budget tok/h", "energy J"):
        devices.add_column(c)
    for name, d in snap["devices"].items():
        budget = d["budget_tokens_per_hour"]
        devices.add_row(name, {True: "yes", False: "no", None: "?"}[d["online"]], _pct(d["battery_soc"]),
                        "-" if budget is None else f"{budget:,.0f}", f"{d['energy_j']:.1f}")

    grid = Table.grid(padding=(0, 2))
    grid.add_row(lat, reasons)
    parts: list[Any] = [flow, grid]
    if engine:
        eng = Table.grid(padding=(0, 2))
        eng.add_row("engine running", str(engine.get("running", "-")), "waiting", str(engine.get("waiting", "-")),
                    "KV blocks used", f"{engine.get('kv_blocks_used', '-')}/{engine.get('kv_blocks_total', '-')}",
                    "prefix hit", _pct(engine.get("prefix_hit_rate")))
        parts.append(Panel(eng, title="cloud engine"))
    parts.append(devices)
    return Panel(Group(*parts), title=title)
