"""The whole mesh under a fixed event rate, with an OTA rollout to every edge and a broker restart mid-run: rate,
latency, edge share, losses, and whether any event was lost or answered twice while the edges swapped models."""
from __future__ import annotations

import time
from pathlib import Path

import typer


def command(
    duration: float = typer.Option(180.0, help="seconds of sensor traffic"),
    rate: float = typer.Option(2.0, help="sensor frames per second, all hives together"),
    sites: int = typer.Option(3, help="sites"),
    devices: int = typer.Option(2, help="hives per site"),
    restart_at: float = typer.Option(0.5, help="restart the broker at this fraction of the run (0 = never)"),
    outage: float = typer.Option(5.0, help="seconds the broker stays down"),
    drain: float = typer.Option(240.0, help="seconds to wait for outstanding answers (and the rollout) after the "
                                           "traffic stops"),
    rollout_at: float = typer.Option(0.2, help="roll a signed image of the edges' model out to every edge at this "
                                               "fraction of the run, canary first (0 = never)"),
    seed: int = typer.Option(0, help="simulation seed"),
    results: Path = typer.Option(Path("results/bench/mesh"), help="run folder (logs, databases)"),
) -> None:
    from apiary.mesh import Mesh, MeshOptions
    from apiary.rollout import summary_rows
    from apiary.bench.common import report
    from apiary.shared.logs import configure

    configure(level="WARNING", fmt="text")
    mesh = Mesh(MeshOptions(sites=sites, devices=devices, rate=rate, seed=seed, use_mosquitto=True,
                            anomaly_window_s=0.6 * duration, rollout=rollout_at > 0,
                            results_dir=results / time.strftime("%Y%m%d-%H%M%S")))
    restarted = False
    asked = rollout_at <= 0  # the cloud took (or refused) the rollout
    try:
        mesh.start(on_step=lambda text: print(f"[mesh] {text}", flush=True))
        t0 = time.monotonic()
        while (elapsed := time.monotonic() - t0) < duration:
            if restart_at and not restarted and elapsed >= restart_at * duration:
                print(f"[mesh] stopping the broker for {outage:.0f} s", flush=True)
                mesh.broker.stop()
                time.sleep(outage)
                mesh.broker.start()
                restarted = True
                print("[mesh] broker back", flush=True)
            if not asked and elapsed >= rollout_at * duration and (asked := mesh.start_rollout()):
                print(f"[mesh] rollout of {mesh.rollout.version}: {mesh.rollout.id or mesh.rollout.error}", flush=True)
            if crashed := mesh.crashed():
                raise SystemExit(f"a component exited: {crashed[0]}")
            time.sleep(0.5)
        traffic_s = time.monotonic() - t0
        mesh.stop_simulator()
        deadline = time.monotonic() + drain
        drained = mesh.drain(drain)
        while not asked and time.monotonic() < deadline:  # the cloud came up late: the rollout still runs
            asked = mesh.start_rollout()
            time.sleep(1.0)
        while mesh.rollout is not None and mesh.rollout_state() is not None and not mesh.rollout.settled \
                and time.monotonic() < deadline:
            time.sleep(1.0)
        drained = mesh.drain(max(0.0, deadline - time.monotonic())) and drained
        snap = mesh.observer.snapshot()
        frames = mesh.frames_sent
        rollout = None
        if mesh.rollout is not None:
            rollout = mesh.rollout.summary()
            if rollout.get("created_at") is not None:
                rollout["during"] = mesh.observer.window(rollout["created_at"], rollout["finished_at"] or time.time())
    finally:
        mesh.stop()

    lat = snap["latency_ms"]
    by_tier = snap["answers_by_tier"]
    answered = snap["answered"]
    cloud_answers = by_tier.get("cloud", 0)
    per_cloud_answer = snap["cloud_tokens"] / cloud_answers if cloud_answers else float("nan")
    all_cloud_tokens = per_cloud_answer * snap["events_needing_answer"]
    rows = [
        ["frames sent / events seen", f"{frames} / {snap['events']}"],
        ["events lost (sent - seen)", frames - snap["events"]],
        ["events/s sustained", snap["events"] / traffic_s],
        ["events needing an answer / answered", f"{snap['events_needing_answer']} / {answered}"],
        ["unanswered after drain", snap["events_needing_answer"] - answered],
        ["double answers", snap["double_answers"]],
        ["edge answers p50 / p99 ms", f"{lat['edge']['p50'] or float('nan'):.0f} / {lat['edge']['p99'] or float('nan'):.0f}"],
        ["cloud answers p50 / p99 ms", f"{lat['cloud']['p50'] or float('nan'):.0f} / {lat['cloud']['p99'] or float('nan'):.0f}"],
        ["share answered at the edge", by_tier.get("edge", 0) / answered if answered else float("nan")],
        ["cloud tokens spent", snap["cloud_tokens"]],
        ["cloud tokens if all went to the cloud (est.)", all_cloud_tokens],
        ["broker restarted mid-run", restarted],
        *map(list, summary_rows(rollout)),
    ]
    report("mesh", f"Mesh: {sites}x{devices} hives, {rate} frames/s for {duration:.0f} s, Mosquitto", ["measure", "value"],
           rows, extra={"snapshot": snap, "frames_sent": frames, "traffic_s": traffic_s, "drained": drained,
                        "restarted": restarted, "cloud_tokens_all_cloud_est": all_cloud_tokens, "rollout": rollout})

