"""What the demo shows while it runs, from an observer snapshot and the cloud's engine gauges.

Any terminal: a full panel on a large one, a compact one below ``COMPACT_BELOW`` (it fits
80x24, and the full one falls back to it whenever it would not fit the height); plain
progress lines when stdout is not a terminal (a pipe, a log file, CI), where a live view
would print nothing until the end. The connect hint is printed unwrapped, since a key
broken over two lines cannot be pasted, and kept in the run's ``connect.txt``.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

COMPACT_BELOW = (100, 30)  # columns, rows: a smaller terminal gets the compact layout
DEVICE_CELL = 30  # characters per device in the compact layout's device grid
# A backlog worth a warning: an event waiting this long for its answer (edge p99 is a few seconds, cloud ~10 s on
# a 2-core machine), or this many waiting per device. Either means answers are falling behind the traffic.
BACKLOG_AGE_S = 30.0
BACKLOG_PER_DEVICE = 3


def _n(v: float | None) -> str:
    """A count (the engine's gauges arrive as floats from Prometheus)."""
    return "-" if v is None else f"{int(v):,}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.0f}%"


def _online(v: bool | None) -> str:
    return {True: "yes", False: "no", None: "?"}[v]


def _reasons(snap: dict[str, Any]) -> list[tuple[str, int]]:
    """Escalation reasons by rule, most frequent first."""
    return sorted(snap["escalation_reasons"].items(), key=lambda kv: (-kv[1], kv[0]))


def backlog_warning(snap: dict[str, Any]) -> str | None:
    """A warning when the events waiting for an answer pile up (see ``BACKLOG_AGE_S``), else None."""
    waiting, oldest = snap.get("unanswered", 0), snap.get("oldest_unanswered_s") or 0.0
    if waiting and (oldest >= BACKLOG_AGE_S or waiting >= BACKLOG_PER_DEVICE * max(1, len(snap["devices"]))):
        return (f"backlog: {waiting} events waiting for an answer, the oldest for {oldest:.0f} s: "
                "answers are falling behind the traffic")
    return None


def drain_title(in_flight: int, waiting: int, seconds_left: float, rollout: str | None = None) -> str:
    """The view's title while the demo waits for its last answers (and its rollout): what is left and the
    countdown (short enough for the compact layout's border at 80 columns)."""
    left = f"{waiting} to answer" + (f", {in_flight} in flight" if in_flight else "") + (f", {rollout}" if rollout
                                                                                         else "")
    return f"demo draining: {left}, {max(0.0, seconds_left):.0f} s left (Ctrl-C stops)"


def _answered(snap: dict[str, Any]) -> str:
    """answered/needing, with how many wait."""
    waiting = snap.get("unanswered", 0)
    return f"{snap['answered']}/{snap['events_needing_answer']}" + (f" ({waiting} waiting)" if waiting else "")


def rollout_text(rollout: dict[str, Any] | None) -> str | None:
    """The OTA rollout in one line (the cloud's view of it: GET /v1/fleet/rollouts/{id}), None when there is none."""
    if not rollout:
        return None
    counts = " · ".join(f"{phase} {n}" for phase, n in sorted(rollout["counts"].items(), key=lambda kv: -kv[1]))
    where = (f"wave {rollout['wave'] + 1}/{rollout['waves']}" if rollout["state"] == "running"
             else f"{rollout['waves']} waves")
    return f"rollout {rollout['image_version']}: {rollout['state']}, {where}: {counts}"


def ota_cell(d: dict[str, Any]) -> str:
    """A device's OTA phase for the view: its newest status (with the download's progress), else '-'."""
    phase = d.get("ota_phase")
    if phase is None:
        return "-"
    if phase == "downloading" and d.get("ota_progress") is not None:
        return f"downloading {d['ota_progress']:.0%}"
    return phase


def _warning_line(snap: dict[str, Any]) -> Text | None:
    warning = backlog_warning(snap)
    return None if warning is None else Text(warning, style="bold red", no_wrap=True, overflow="ellipsis")


def _engine_fields(engine: dict[str, Any]) -> list[tuple[str, str]]:
    """The engine gauges shown, under the keys ``LLMEngine.metrics()`` exports (``apiary_engine_*``)."""
    return [("running", _n(engine.get("requests_running"))), ("waiting", _n(engine.get("requests_waiting"))),
            ("KV blocks", f"{_n(engine.get('kv_blocks_used'))}/{_n(engine.get('kv_blocks_total'))}"),
            ("prefix hit", _pct(engine.get("prefix_hit_rate")))]


# ---------------------------------------------------------------------- layouts


def full_layout(snap: dict[str, Any], engine: dict[str, Any], title: str) -> Panel:
    """Every number, the latency table, reasons by rule and one row per device."""
    flow = Table.grid(padding=(0, 2))
    flow.add_row("elapsed", f"{snap['elapsed_s']:.0f} s", "events", str(snap["events"]),
                 "events/s (10 s)", f"{snap['events_per_s_10s']:.1f}")
    tiers = snap["answers_by_tier"]
    flow.add_row("needing an answer", str(snap["events_needing_answer"]), "answered", str(snap["answered"]),
                 "edge / cloud", f"{tiers.get('edge', 0)} / {tiers.get('cloud', 0)}")
    flow.add_row("waiting for an answer", str(snap.get("unanswered", 0)), "oldest waiting",
                 "-" if snap.get("oldest_unanswered_s") is None else f"{snap['oldest_unanswered_s']:.0f} s", "", "")
    flow.add_row("escalations", str(snap["escalations"]), "anomalies caught / injected",
                 f"{snap['anomalies_caught']} / {snap['anomalies_injected']}", "double answers",
                 str(snap["double_answers"]))

    lat = Table(title="event → final answer (ms)", expand=False)
    for c in ("tier", "n", "p50", "p99"):
        lat.add_column(c)
    for tier, v in snap["latency_ms"].items():
        lat.add_row(tier, str(v["n"]), _ms(v["p50"]), _ms(v["p99"]))

    reasons = Table(title="escalation reasons")
    reasons.add_column("rule")
    reasons.add_column("count")
    for rule, n in _reasons(snap):
        reasons.add_row(rule, str(n))

    devices = Table(title="devices")
    for c in ("device", "online", "battery", "budget tok/h", "energy J", "image", "OTA"):
        devices.add_column(c)
    for name, d in snap["devices"].items():
        budget = d["budget_tokens_per_hour"]
        devices.add_row(name, _online(d["online"]), _pct(d["battery_soc"]),
                        "-" if budget is None else f"{budget:,.0f}", f"{d['energy_j']:.1f}",
                        d.get("image_version") or "-", ota_cell(d))

    grid = Table.grid(padding=(0, 2))
    grid.add_row(lat, reasons)
    parts: list[Any] = [flow, grid]
    if (warning := _warning_line(snap)) is not None:
        parts.insert(1, warning)
    if engine:
        parts.append(Panel(_engine_line(engine), title="cloud engine"))
    if (rollout := rollout_text(snap.get("rollout"))) is not None:
        parts.append(Text(rollout, no_wrap=True, overflow="ellipsis"))
    parts.append(devices)
    return Panel(Group(*parts), title=title)


def _engine_line(engine: dict[str, Any]) -> Text:
    if not engine:
        return Text("engine  no metrics yet", no_wrap=True, overflow="ellipsis")
    text = Text("engine", no_wrap=True, overflow="ellipsis")
    for label, value in _engine_fields(engine):
        text.append(f"  {label} ")
        text.append(value, style="bold")
    return text


def _line(*parts: tuple[str, str]) -> Text:
    """One compact row: (label, value) pairs, cut with an ellipsis rather than wrapped."""
    text = Text(no_wrap=True, overflow="ellipsis")
    for i, (label, value) in enumerate(parts):
        text.append(("   " if i else "") + label + " ")
        text.append(value, style="bold")
    return text


def compact_layout(snap: dict[str, Any], engine: dict[str, Any], title: str, width: int, height: int) -> Panel:
    """The same story in one line per topic and a device grid cut to the rows left (80x24 and up)."""
    tiers, lat = snap["answers_by_tier"], snap["latency_ms"]
    rows: list[Text] = [
        _line(("events", f"{snap['events']} ({snap['events_per_s_10s']:.1f}/s)"),
              ("answered", _answered(snap)),
              ("edge/cloud", f"{tiers.get('edge', 0)}/{tiers.get('cloud', 0)}"),
              ("elapsed", f"{snap['elapsed_s']:.0f} s")),
        _line(("escalations", str(snap["escalations"])),
              ("anomalies caught", f"{snap['anomalies_caught']}/{snap['anomalies_injected']}"),
              ("double answers", str(snap["double_answers"]))),
        _line(*((f"{tier} p50/p99 ms", f"{_ms(v['p50'])}/{_ms(v['p99'])}") for tier, v in lat.items())),
        _engine_line(engine),
        _line(("reasons", " · ".join(f"{rule} {n}" for rule, n in _reasons(snap)) or "-")),
    ]
    if (warning := _warning_line(snap)) is not None:
        rows.insert(1, warning)
    if (rollout := rollout_text(snap.get("rollout"))) is not None:
        rows.append(Text(rollout, no_wrap=True, overflow="ellipsis"))
    devices = snap["devices"]
    socs = [d["battery_soc"] for d in devices.values() if d["battery_soc"] is not None]
    rows.append(_line(("devices online", f"{sum(1 for d in devices.values() if d['online'])}/{len(devices)}"),
                      ("battery min", _pct(min(socs)) if socs else "-"),
                      ("energy", f"{sum(d['energy_j'] for d in devices.values()):.1f} J")))
    per_row = max(1, (width - 4) // DEVICE_CELL)
    room = max(0, height - 1 - 2 - len(rows))  # a line for the cursor, two for the border
    cells = [f"{name} {_online(d['online'])} {_pct(d['battery_soc'])} "
             + (ota_cell(d).replace("downloading", "dl") if d.get("ota_phase") else f"{d['energy_j']:.1f}J")
             for name, d in devices.items()]
    grid = [cells[i:i + per_row] for i in range(0, len(cells), per_row)]
    if len(grid) > room:
        shown = max(0, room - 1) * per_row
        grid = grid[:max(0, room - 1)] + ([[f"… and {len(cells) - shown} more devices"]] if room else [])
    for cell_row in grid:
        rows.append(Text("".join(c[:DEVICE_CELL - 1].ljust(DEVICE_CELL) for c in cell_row).rstrip(),
                         no_wrap=True, overflow="ellipsis"))
    return Panel(Group(*rows), title=title)


class DemoPanel:
    """The live panel: the full layout where it fits, the compact one otherwise (decided at each render,
    from the console's size)."""

    def __init__(self, snap: dict[str, Any], engine: dict[str, Any] | None, title: str) -> None:
        self.snap, self.engine, self.title = snap, engine or {}, title

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width, height = options.max_width, options.size.height
        if width >= COMPACT_BELOW[0] and height >= COMPACT_BELOW[1]:
            full = full_layout(self.snap, self.engine, self.title)
            if len(console.render_lines(full, options, pad=False)) < height:
                yield full
                return
        yield compact_layout(self.snap, self.engine, self.title, width, height)


def render(snap: dict[str, Any], engine: dict[str, Any] | None = None, title: str = "Apiary Mesh demo") -> DemoPanel:
    return DemoPanel(snap, engine, title)


def progress_line(snap: dict[str, Any], engine: dict[str, Any] | None, title: str) -> str:
    """The view as one plain line, for a stdout that is not a terminal."""
    tiers = snap["answers_by_tier"]
    line = (f"{title}: events {snap['events']}, answered {_answered(snap)} "
            f"(edge {tiers.get('edge', 0)}, cloud {tiers.get('cloud', 0)}), escalations {snap['escalations']}, "
            f"anomalies caught {snap['anomalies_caught']}/{snap['anomalies_injected']}")
    if engine:
        line += ", engine " + " ".join(f"{k} {v}" for k, v in _engine_fields(engine))
    if (rollout := rollout_text(snap.get("rollout"))) is not None:
        line += f"; {rollout}"
    if (warning := backlog_warning(snap)) is not None:
        line += f"; {warning}"
    return line


# ---------------------------------------------------------------------- showing it


class DemoView:
    """Shows each update: a live panel on a terminal (``live``), else a plain progress line whenever it
    changed, at most one per ``interval_s``; the last line is never dropped.

    Use as a context manager; ``update`` is cheap to call every second.
    """

    def __init__(self, console: Console, *, live: bool = True, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console
        self.live = live and console.is_terminal and not console.is_dumb_terminal
        self.interval_s = interval_s
        self._clock = clock
        self._live: Live | None = None
        self._printed: str | None = None
        self._printed_at: float | None = None
        self._pending: str | None = None

    def __enter__(self) -> "DemoView":
        if self.live:
            self._live = Live(console=self.console, auto_refresh=False, transient=False)
            self._live.start()
        return self

    def update(self, snap: dict[str, Any], engine: dict[str, Any] | None, title: str) -> None:
        if self._live is not None:
            self._live.update(render(snap, engine, title), refresh=True)
            return
        line = progress_line(snap, engine, title)
        now = self._clock()
        if line == self._printed:
            self._pending = None
        elif self._printed_at is None or now - self._printed_at >= self.interval_s:
            self._print(line, now)
        else:
            self._pending = line

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        elif self._pending is not None:
            self._print(self._pending, self._clock())

    def _print(self, line: str, now: float) -> None:
        self.console.print(line, soft_wrap=True, markup=False, highlight=False)
        self._printed, self._printed_at, self._pending = line, now, None


def connect_lines(cloud_url: str, api_key: str, broker_url: str, log_dir: Path | str) -> Iterator[tuple[str, str]]:
    """(label, value) pairs: how to reach a running mesh."""
    yield "REST API", cloud_url
    yield "API key", api_key
    yield "try", f"curl -H 'Authorization: Bearer {api_key}' {cloud_url}/v1/fleet/devices"
    yield "shell", f"export URL={cloud_url} KEY={api_key}"  # what the README's step 2 expects
    yield "broker", str(broker_url)
    yield "logs", str(log_dir)


def show_connect(console: Console, run_dir: Path, cloud_url: str, api_key: str, broker_url: str,
                 log_dir: Path | str) -> Path:
    """Print the connect hint one unwrapped line per item (a key or command broken at 80 columns cannot be
    pasted) and write the same lines to ``run_dir/connect.txt``; returns that path."""
    pairs = list(connect_lines(cloud_url, api_key, broker_url, log_dir))
    for label, value in pairs:
        console.print(Text.assemble((label, "bold"), " ", value), soft_wrap=True)
    path = Path(run_dir) / "connect.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{label}: {value}\n" for label, value in pairs))
    console.print(Text.assemble(("saved", "bold"), " ", str(path)), soft_wrap=True)
    return path
