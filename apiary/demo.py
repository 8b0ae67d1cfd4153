"""`apiary demo`: the whole mesh on one machine with a live view, then a summary, a chart and JSON."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def demo(
    duration: float = typer.Option(120.0, help="seconds of simulated sensor traffic (Ctrl-C stops early)"),
    broker: Optional[str] = typer.Option(None, help="use this broker (mqtt://host:port) instead of the embedded one"),
    sites: int = typer.Option(3, help="sites"),
    devices: int = typer.Option(2, help="hives per site (one edge agent each)"),
    rate: float = typer.Option(2.0, help="sensor frames per second, all hives together"),
    seed: int = typer.Option(0, help="simulation seed"),
    results: Path = typer.Option(Path("results/demo"), help="folder for the summary, chart and logs"),
    drain: float = typer.Option(120.0, help="after the traffic stops, wait this long for outstanding answers"),
    live: bool = typer.Option(True, help="show the live terminal view"),
) -> None:
    """Run broker, cloud, edge agents, bridge and simulator with injected anomalies; Ctrl-C stops."""
    from rich.console import Console

    from apiary.chart import save_chart
    from apiary.mesh import Mesh, MeshError, MeshOptions
    from apiary.view import DemoView, show_connect
    from shared.logs import configure

    configure(level="WARNING", fmt="text")
    console = Console()
    run_dir = results / time.strftime("%Y%m%d-%H%M%S")
    mesh = Mesh(MeshOptions(sites=sites, devices=devices, rate=rate, seed=seed, broker_url=broker,
                            results_dir=run_dir, anomaly_window_s=0.6 * duration))
    interrupted = False
    try:
        with console.status("starting the mesh…") as status:
            mesh.start(on_step=lambda text: status.update(f"starting the mesh… {text}"))
        show_connect(console, run_dir, mesh.cloud_url, mesh.api_key, mesh.mqtt.url, mesh.supervisor.log_dir)
        end = time.monotonic() + duration
        with DemoView(console, live=live) as view:
            def refresh(title: str) -> None:
                view.update(mesh.observer.snapshot(), mesh.engine_metrics(), title)

            try:
                while time.monotonic() < end:
                    if crashed := mesh.crashed():
                        raise MeshError(f"a component exited: {crashed[0]}")
                    refresh(f"Apiary Mesh demo — {end - time.monotonic():.0f} s of traffic left")
                    time.sleep(1.0)
            except KeyboardInterrupt:
                interrupted = True
            mesh.stop_simulator()
            if not interrupted:
                deadline = time.monotonic() + drain
                try:
                    while time.monotonic() < deadline and not mesh.drain(1.0):
                        refresh("Apiary Mesh demo — waiting for the last answers")
                except KeyboardInterrupt:
                    interrupted = True
            refresh("Apiary Mesh demo — final")
        summary = {**mesh.observer.snapshot(), "engine": mesh.engine_metrics(), "frames_sent": mesh.frames_sent,
                   "interrupted": interrupted, "options": {"duration": duration, "sites": sites, "devices": devices,
                                                           "rate": rate, "seed": seed}}
        chart = save_chart(mesh.observer.latencies(), mesh.observer.tier_timeline(), mesh.observer.started,
                           run_dir / "latency.png")
    except MeshError as e:
        console.print(f"[red]error:[/red] {e}")
        mesh.stop()
        raise typer.Exit(1) from None
    finally:
        mesh.stop()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    _print_summary(console, summary)
    console.print(f"summary: {run_dir / 'summary.json'}   chart: {chart}")


def _print_summary(console, s: dict) -> None:
    from rich.table import Table

    t = Table(title="Apiary Mesh demo — summary")
    t.add_column("measure")
    t.add_column("value", justify="right")
    lat = s["latency_ms"]
    rows = [
        ("frames sent by the simulator", s["frames_sent"]),
        ("sensor events", s["events"]),
        ("events that needed an answer", s["events_needing_answer"]),
        ("answered (edge / cloud)", f"{s['answered']} ({s['answers_by_tier'].get('edge', 0)} / "
                                    f"{s['answers_by_tier'].get('cloud', 0)})"),
        ("escalations", s["escalations"]),
        ("double answers", s["double_answers"]),
        ("edge latency p50 / p99 (ms)", f"{_f(lat['edge']['p50'])} / {_f(lat['edge']['p99'])}"),
        ("cloud latency p50 / p99 (ms)", f"{_f(lat['cloud']['p50'])} / {_f(lat['cloud']['p99'])}"),
        ("anomalies caught / injected", f"{s['anomalies_caught']} / {s['anomalies_injected']}"),
        ("anomaly events named exactly", s["anomalies_exact"]),
        *((f"{tier} answers right (ground truth)", f"{a['right']} / {a['graded']} ({a['accuracy']:.0%})")
          for tier, a in s["accuracy_by_tier"].items()),
        ("cloud tokens", s["cloud_tokens"]),
    ]
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"
