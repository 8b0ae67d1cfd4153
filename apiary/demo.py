"""`apiary demo`: the whole mesh on one machine with a live view, then a summary, a chart and JSON."""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def demo(
    duration: float = typer.Option(120.0, help="seconds of simulated sensor traffic (Ctrl-C stops it early)"),
    broker: Optional[str] = typer.Option(None, help="use this broker (mqtt://host:port) instead of the embedded one"),
    sites: int = typer.Option(3, help="sites"),
    devices: int = typer.Option(2, help="hives per site (one edge agent each)"),
    rate: float = typer.Option(2.0, help="sensor frames per second, all hives together"),
    seed: int = typer.Option(0, help="simulation seed"),
    results: Path = typer.Option(Path("results/demo"), help="folder for the summary, chart and logs"),
    drain: float = typer.Option(120.0, help="after the traffic stops, wait up to this long for the answers still "
                                           "outstanding (a countdown shows it; Ctrl-C again stops at once)"),
    live: bool = typer.Option(True, help="show the live terminal view (plain progress lines when not a terminal)"),
    rollout: bool = typer.Option(True, help="roll a freshly signed image of the edges' model out to every device "
                                            "(a canary wave, then the rest) through the cloud's REST API"),
    rollout_at: float = typer.Option(0.5, min=0.0, max=1.0, help="when the rollout starts, as a fraction of "
                                                                 "--duration (or as soon as the cloud is up)"),
) -> None:
    """Run broker, cloud, edge agents, bridge and simulator with injected anomalies, roll a signed edge image out
    halfway through, then answer every event still waiting (and let the rollout finish); Ctrl-C stops the traffic
    early (and waits for those answers), a second Ctrl-C stops at once."""
    from rich.console import Console

    from apiary.chart import save_chart
    from apiary.mesh import Mesh, MeshError, MeshOptions
    from apiary.view import DemoView, drain_title, show_connect
    from apiary.shared.logs import configure

    launched = time.time()
    configure(level="WARNING", fmt="text")
    console = Console()
    run_dir = results / time.strftime("%Y%m%d-%H%M%S")
    mesh = Mesh(MeshOptions(sites=sites, devices=devices, rate=rate, seed=seed, broker_url=broker,
                            results_dir=run_dir, anomaly_window_s=0.6 * duration, early_first_anomaly=True,
                            traffic_before_cloud=True, rollout=rollout))
    startup: list[tuple[str, float]] = []
    traffic_stopped_early = drain_stopped_early = False
    summary: dict = {}
    chart = None
    terminated = []  # SIGTERM (a service manager, `kill`): stop at once, without the drain, but clean up

    def on_sigterm(*_: object) -> None:
        terminated.append(True)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even where a shell started us ignoring it

    def step(text: str) -> None:
        startup.append((text, round(time.time() - launched, 2)))
        if not console.is_terminal:  # a status spinner shows nothing in a log: say each step as it happens
            console.print(f"starting the mesh… {text} ({startup[-1][1]:.1f} s)", soft_wrap=True, highlight=False)

    try:
        with console.status("starting the mesh…") as status:
            mesh.start(on_step=lambda text: (step(text), status.update(f"starting the mesh… {text}")))
        show_connect(console, run_dir, mesh.cloud_url, mesh.api_key, mesh.mqtt.url, mesh.supervisor.log_dir)
        with DemoView(console, live=live) as view:
            def refresh(title: str) -> None:
                view.update({**mesh.observer.snapshot(), "rollout": mesh.rollout_state()}, mesh.engine_metrics(),
                            title)

            end = mesh.traffic_started + duration  # the traffic began while the cloud was still loading
            rollout_from = mesh.traffic_started + rollout_at * duration
            asked = not rollout  # the cloud took (or refused) the rollout

            def ask_for_rollout() -> bool:
                return asked or (time.monotonic() >= rollout_from and mesh.start_rollout())

            try:
                while time.monotonic() < end:
                    if crashed := mesh.crashed():
                        raise MeshError(f"a component exited: {crashed[0]}")
                    asked = ask_for_rollout()
                    refresh(f"Apiary Mesh demo — {end - time.monotonic():.0f} s of traffic left")
                    time.sleep(1.0)
            except KeyboardInterrupt:
                traffic_stopped_early = True
            mesh.stop_simulator()
            drain_started = time.monotonic()
            deadline = drain_started + (0.0 if terminated else drain)
            want_rollout = rollout and (asked or not traffic_stopped_early)  # a rollout started is seen to its end
            try:
                while True:
                    answered = mesh.drain(min(1.0, max(0.0, deadline - time.monotonic())))
                    if want_rollout:
                        asked = ask_for_rollout() if not traffic_stopped_early else asked
                        mesh.rollout_state()
                    if answered and (not want_rollout or (asked and mesh.rollout.settled)):
                        break
                    if time.monotonic() >= deadline:
                        break
                    if crashed := mesh.crashed():
                        raise MeshError(f"a component exited: {crashed[0]}")
                    refresh(drain_title(*mesh.outstanding(), deadline - time.monotonic(),
                                        rollout=_rollout_word(mesh) if want_rollout else None))
                    if answered:  # only the rollout is left: drain() returned at once
                        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            except KeyboardInterrupt:
                drain_stopped_early = True
            drain_s = time.monotonic() - drain_started
            refresh("Apiary Mesh demo — final")
        snap = mesh.observer.snapshot()
        left_unanswered = mesh.observer.unanswered()
        first = snap["first_answer_at"]
        summary = {**snap, "engine": mesh.engine_metrics(), "frames_sent": mesh.frames_sent,
                   "first_answer_after_launch_s": None if first is None else first - launched,
                   "startup_s": startup, "left_unanswered": left_unanswered,
                   "drain": {"seconds": drain_s, "limit_s": drain, "stopped_early": drain_stopped_early,
                             "complete": mesh.outstanding() == (0, 0)},
                   "traffic_stopped_early": traffic_stopped_early,
                   "rollout": _rollout_summary(mesh),
                   "interrupted": traffic_stopped_early or drain_stopped_early,
                   "options": {"duration": duration, "sites": sites, "devices": devices, "rate": rate, "seed": seed,
                               "drain": drain}}
        chart = save_chart(mesh.observer.latencies(), mesh.observer.tier_timeline(), mesh.observer.started,
                           run_dir / "latency.png")
    except MeshError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # the stop itself is bounded (the supervisor kills what hangs)
            signal.signal(sig, signal.SIG_IGN)
        mesh.stop()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    _print_summary(console, summary)
    if left := summary["left_unanswered"]:
        why = ("stopped by SIGTERM" if terminated else "you stopped the wait" if drain_stopped_early else
               f"the wait for answers ended after {drain:.0f} s (--drain)")
        console.print(f"[yellow]left unanswered:[/yellow] {len(left)} events that needed an answer ({why}): "
                      + ", ".join(left[:10]) + (f" and {len(left) - 10} more" if len(left) > 10 else ""),
                      soft_wrap=True)
    console.print(f"summary: {run_dir / 'summary.json'}   chart: {chart}")


def _rollout_word(mesh) -> str | None:
    """What the drain title says of the rollout: None when there is none to wait for."""
    state = mesh.rollout_state()
    if state is None:
        return None if mesh.rollout.error else "rollout starting"
    return None if state["state"] != "running" else f"rollout wave {state['wave'] + 1}/{state['waves']}"


def _rollout_summary(mesh) -> dict | None:
    """The rollout's summary, with what happened to the events that arrived while it swapped models."""
    if mesh.rollout is None:
        return None
    mesh.rollout_state()
    out = mesh.rollout.summary()
    if out.get("created_at") is not None:
        out["during"] = mesh.observer.window(out["created_at"], out["finished_at"] or time.time())
    return out


def _print_summary(console, s: dict) -> None:
    from rich.table import Table

    from apiary.rollout import summary_rows

    t = Table(title="Apiary Mesh demo — summary")
    t.add_column("measure")
    t.add_column("value", justify="right")
    lat = s["latency_ms"]
    rows = [
        ("frames sent by the simulator", s["frames_sent"]),
        ("sensor events", s["events"]),
        ("events that needed an answer", s["events_needing_answer"]),
        ("answered / needing an answer", _share(s["events_needing_answer"] - s["unanswered"],
                                                 s["events_needing_answer"])),
        ("answers (edge / cloud)", f"{s['answered']} ({s['answers_by_tier'].get('edge', 0)} / "
                                   f"{s['answers_by_tier'].get('cloud', 0)})"),
        ("first answer after launch (s)", "-" if s["first_answer_after_launch_s"] is None
                                          else f"{s['first_answer_after_launch_s']:.1f}"),
        ("escalations", s["escalations"]),
        ("double answers", s["double_answers"]),
        ("edge latency p50 / p99 (ms)", f"{_f(lat['edge']['p50'])} / {_f(lat['edge']['p99'])}"),
        ("cloud latency p50 / p99 (ms)", f"{_f(lat['cloud']['p50'])} / {_f(lat['cloud']['p99'])}"),
        ("anomalies caught / injected", f"{s['anomalies_caught']} / {s['anomalies_injected']}"),
        ("anomaly events named exactly", s["anomalies_exact"]),
        *((f"{tier} answers right (ground truth)", f"{a['right']} / {a['graded']} ({a['accuracy']:.0%})")
          for tier, a in s["accuracy_by_tier"].items()),
        ("cloud tokens", s["cloud_tokens"]),
        *summary_rows(s.get("rollout")),
    ]
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)


def _share(part: int, whole: int) -> str:
    return f"{part} / {whole}" + (f" ({part / whole:.0%})" if whole else "")


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"
