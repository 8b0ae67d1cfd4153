"""The demo's view on recorded observer state: engine gauges under the keys the engine exports, KV blocks
as integers, escalation reasons by rule, anomalies caught by ground truth, a live view that fits 80x24,
plain progress lines off a terminal, and a connect hint that survives copy and paste."""
from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from apiary.observer import MeshObserver
from apiary.view import (BACKLOG_AGE_S, DemoView, backlog_warning, drain_title, progress_line, render,
                         show_connect)
from apiary.edge.policy import Attempt, EscalationPolicy, Plan, Situation, rule_of
from apiary.edge.settings import PolicySettings
from apiary.shared.config import MqttConfig
from apiary.shared.protocol import DeviceState, InferenceRequest, InferenceResult, SensorEvent, Severity, make

SITES, HIVES = 3, 2  # the demo's default fleet: six edge agents


def decide(confidence: float, *, flags: tuple[str, ...] = (), severity: Severity = Severity.WARNING) -> str:
    """An escalation's reason as an edge agent writes it (edge.responder joins the policy's with '; ')."""
    policy = EscalationPolicy(PolicySettings(critical_flags=["weight_drop"]))
    situation = Situation(severity=severity, kind="reading", flags=flags, want_cloud=False, link_up=True)
    decision = policy.decide(situation, Plan(run_model=True, reasons=tuple(policy.critical(situation))),
                             Attempt(valid=True, confidence=confidence))
    assert decision.escalate
    return "; ".join(decision.reasons)


def recorded_observer() -> MeshObserver:
    """An observer fed what it would have seen on the wire: events (two injected anomalies over several
    frames each), escalations with the policy's own reason texts, answers and device states."""
    obs = MeshObserver(MqttConfig())  # never started: the handlers are fed directly
    answers = {  # (device, seq) -> assessment of the answer to that event
        ("hive-0", 11): "normal", ("hive-0", 12): "heat_stress",  # heat_stress 10..13: caught at its 3rd frame
        ("hive-1", 20): "normal", ("hive-1", 21): "robbing",  # swarming 20..22 on hive-1: named wrong
    }
    truths = {("hive-0", s): "heat_stress" for s in range(10, 14)} | {("hive-1", s): "swarming" for s in (20, 21, 22)}
    for site in range(SITES):
        for hive in range(HIVES):
            device, name = f"hive-{hive}", f"site-{site}"
            state = DeviceState(site=name, device=device, status="birth", online=hive != 1 or site > 0, session=1,
                                battery_soc=0.9 - 0.1 * hive, budget_tokens_per_hour=4e3)
            obs._on_state("", make(state, sender=device))
            for seq in range(8, 32):
                truth = truths.get((device, seq), "normal") if site == 0 else "normal"
                flagged = truth != "normal" or seq in (10, 20)
                ev = SensorEvent(site=name, device=device, seq=seq, timestamp=1.7e9 + 300 * seq, truth=truth,
                                 readings={"hive_temp_c": 35.0}, flags=["hive_temp_high"] if flagged else [],
                                 severity=Severity.WARNING if flagged else Severity.INFO)
                obs._on_event("", make(ev, sender="bridge"))
                assessment = answers.get((device, seq)) if site == 0 else ("normal" if flagged else None)
                if assessment is None:
                    continue
                critical = ("weight_drop",) if (site, device, seq) == (0, "hive-1", 20) else ()
                reason = decide(-1.0 - seq / 100, flags=critical)
                obs._on_escalation("", make(InferenceRequest(request_id=f"{name}-{device}-{seq}", site=name,
                                                             device=device, reason=reason), sender=device))
                obs._on_answer("", make(InferenceResult(
                    request_id=f"{name}-{device}-{seq}", site=name, device=device, tier="cloud" if seq % 2 else "edge",
                    action={"assessment": assessment, "action": "inspect", "urgency": "low"}, event_seq=seq,
                    energy_j=1.5), sender=device))
    return obs


@pytest.fixture(scope="module")
def snap() -> dict[str, Any]:
    return recorded_observer().snapshot()


@pytest.fixture(scope="module")
def engine_gauges(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """What the demo scrapes: a real engine's metrics() through the cloud's Prometheus export, parsed as
    apiary.mesh.Mesh.engine_metrics parses /metrics (floats, 'apiary_engine_' stripped)."""
    from prometheus_client.parser import text_string_to_metric_families

    from apiary.cloud.engine import EngineConfig, LLMEngine, SamplingParams
    from apiary.cloud.metrics import Metrics
    from tests.cloud.engine.tiny import make_checkpoint

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LLMEngine(EngineConfig(model_path=make_checkpoint(tmp_path_factory.mktemp("tiny"), "llama"),
                                        kv_cache_bytes=8 << 20, block_size=4, max_num_seqs=2))
        for i in range(3):
            engine.add_request([5, 6, 7, 8, 9], params=SamplingParams(max_tokens=8), request_id=f"r{i}")
        engine.step()  # two running, one waiting, KV blocks in use
        metrics = Metrics()
        metrics.watch_engine(engine.metrics)
        families = text_string_to_metric_families(metrics.render().decode())
    finally:
        torch.set_num_threads(threads)
    return {s.name.removeprefix("apiary_engine_"): s.value for f in families if f.name.startswith("apiary_engine_")
            for s in f.samples}


def shown(renderable: Any, width: int, height: int, terminal: bool = False) -> list[str]:
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=terminal, record=True)
    console.print(renderable)
    return console.export_text().rstrip("\n").split("\n")


# ---------------------------------------------------------------------- the numbers


def test_reasons_are_counted_by_rule_not_by_value(snap) -> None:
    assert rule_of("low confidence: p10 logprob -1.12 < -0.78") == "low confidence"
    assert rule_of("flag weight_drop, swarm_risk is critical") == "critical flag"
    assert rule_of("high entropy: 2.10 nats > 1.50") == "high entropy"
    assert rule_of("operator asked for a cloud answer") == "operator asked for a cloud answer"
    # 12 escalations, every one with its own logprob value; one also had a critical flag
    # Needing an answer is the edge's own triage: the 17 flagged events, plus the 2 readings after each of
    # the 12 flagged runs (edge.triage.WATCH_CONTEXT keeps the device watched), which the agent answers too.
    assert snap["escalations"] == 4 + 2 * 2 * 2 and snap["events_needing_answer"] == 5 + 4 + 8 + 2 * 12
    assert snap["escalation_reasons"] == {"low confidence": 12, "critical flag": 1}


def test_anomalies_caught_counts_anomalies_named_right(snap) -> None:
    # Two anomalies injected (4 and 3 frames): heat_stress answered heat_stress once -> caught;
    # swarming answered "robbing" -> not caught. Per event, one answer named its anomaly.
    assert (snap["anomalies_injected"], snap["anomalies_caught"]) == (2, 1)
    assert (snap["anomaly_events"], snap["anomalies_exact"]) == (7, 1)


def test_engine_gauges_are_read_under_the_keys_the_engine_exports(snap, engine_gauges) -> None:
    assert (engine_gauges["requests_running"], engine_gauges["requests_waiting"]) == (2.0, 1.0)
    text = "\n".join(shown(render(snap, engine_gauges, "demo"), 120, 50))
    used, total = int(engine_gauges["kv_blocks_used"]), int(engine_gauges["kv_blocks_total"])
    assert used > 0 and f"running 2  waiting 1  KV blocks {used:,}/{total:,}" in text
    assert ".0/" not in text and "running -" not in text


# ---------------------------------------------------------------------- any terminal


@pytest.mark.parametrize("width,height", [(80, 24), (99, 40), (140, 29)])
def test_small_terminals_get_the_compact_layout_and_it_fits(snap, engine_gauges, width, height) -> None:
    lines = shown(render(snap, engine_gauges, "Apiary Mesh demo — 85 s of traffic left"), width, height)
    assert len(lines) < height and max(len(line) for line in lines) <= width
    text = "\n".join(lines)
    assert "answered 12/" in text and "anomalies caught 1/2" in text and "low confidence 12" in text
    assert "running 2" in text and "devices online 5/6" in text


def test_a_fleet_too_large_for_the_screen_is_cut_with_a_count(snap) -> None:
    devices = {f"site-{i}/hive-{j}": d for i in range(10) for j, d in enumerate(snap["devices"].values())}
    lines = shown(render({**snap, "devices": devices}, None, "demo"), 80, 24)
    assert len(lines) < 24 and "more devices" in "\n".join(lines)


def test_large_terminals_get_the_full_layout(snap, engine_gauges) -> None:
    lines = shown(render(snap, engine_gauges, "demo"), 120, 50)
    text = "\n".join(lines)
    assert len(lines) < 50 and "budget tok/h" in text and "cloud engine" in text
    assert "│ low confidence" in text and "│ critical flag" in text


def test_without_a_terminal_plain_lines_once_per_second_or_per_change(snap, tmp_path) -> None:
    out = io.StringIO()
    now = [0.0]
    with DemoView(Console(file=out, width=80), clock=lambda: now[0]) as view:
        view.update(snap, None, "demo — 90 s left")
        view.update(snap, None, "demo — 90 s left")  # nothing changed: nothing printed
        now[0] = 0.5
        view.update(snap, None, "demo — 89 s left")  # changed, but within the second: held back
        now[0] = 1.2
        view.update(snap, None, "demo — 88 s left")
        now[0] = 1.4
        view.update(snap, None, "demo — final")  # the last one is printed on exit
    lines = out.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == ["demo — 90 s left", "demo — 88 s left", "demo — final"]
    assert all("\x1b" not in line for line in lines)  # no terminal control codes in a log file
    assert "answered 12/" in lines[0] and len(lines[0]) > 80  # one line each, never wrapped at 80


def test_on_a_terminal_the_view_is_live(snap) -> None:
    out = io.StringIO()
    with DemoView(Console(file=out, width=80, height=24, force_terminal=True)) as view:
        view.update(snap, None, "demo")
    assert "\x1b[" in out.getvalue() and "anomalies caught" in out.getvalue()


def test_connect_hint_is_unwrapped_and_saved(tmp_path: Path) -> None:
    key = "ak_" + "x7" * 30
    out = io.StringIO()
    path = show_connect(Console(file=out, width=80), tmp_path / "run", "http://127.0.0.1:43117", key,
                        "mqtt://127.0.0.1:1883", tmp_path / "run" / "logs")
    curl = f"curl -H 'Authorization: Bearer {key}' http://127.0.0.1:43117/v1/fleet/devices"
    printed = out.getvalue().splitlines()
    assert f"try {curl}" in printed and f"API key {key}" in printed
    saved = path.read_text().splitlines()
    assert path == tmp_path / "run" / "connect.txt" and f"try: {curl}" in saved and f"API key: {key}" in saved


# ---------------------------------------------------------------------- backlog and drain


def test_a_backlog_is_warned_about_in_every_layout(snap, engine_gauges) -> None:
    # 41 events needed an answer, 12 got one: 29 wait, more than BACKLOG_PER_DEVICE for each of the six devices
    assert (snap["events_needing_answer"], snap["unanswered"]) == (41, 29)
    warning = backlog_warning(snap)
    assert warning and warning.startswith("backlog: 29 events waiting for an answer")
    assert "backlog: 29 events waiting" in "\n".join(shown(render(snap, engine_gauges, "demo"), 80, 24))
    assert "backlog: 29 events waiting" in "\n".join(shown(render(snap, engine_gauges, "demo"), 140, 60))
    assert "; backlog: 29 events waiting" in progress_line(snap, engine_gauges, "demo")
    assert "answered 12/41 (29 waiting)" in progress_line(snap, engine_gauges, "demo")


def test_a_short_queue_is_no_backlog_but_a_stale_one_is(snap) -> None:
    assert backlog_warning({**snap, "unanswered": 0, "oldest_unanswered_s": None}) is None
    assert backlog_warning({**snap, "unanswered": 2, "oldest_unanswered_s": 3.0}) is None  # answers keep up
    stale = backlog_warning({**snap, "unanswered": 1, "oldest_unanswered_s": BACKLOG_AGE_S + 12})
    assert stale and f"the oldest for {BACKLOG_AGE_S + 12:.0f} s" in stale
    assert "backlog" not in progress_line({**snap, "unanswered": 0, "oldest_unanswered_s": None}, None, "demo")


def test_the_drain_countdown_shows_in_plain_progress_lines(snap) -> None:
    out = io.StringIO()
    now = [0.0]
    with DemoView(Console(file=out, width=80), clock=lambda: now[0]) as view:
        for left in (120.0, 119.0, 118.0):
            view.update(snap, None, drain_title(1, 29, left))
            now[0] += 1.0
    lines = out.getvalue().splitlines()
    titles = [f"demo draining: 29 to answer, 1 in flight, {s} s left (Ctrl-C stops): " for s in (120, 119, 118)]
    assert len(lines) == 3 and all(line.startswith(title) for line, title in zip(lines, titles)), lines


def test_the_drain_countdown_fits_the_compact_layout(snap) -> None:
    title = drain_title(12, 120, 118.2)
    lines = shown(render(snap, None, title), 80, 24)
    assert f" {title} " in lines[0] and len(lines[0]) <= 80


def test_drain_waits_for_every_event_sent_and_every_answer(tmp_path: Path) -> None:
    """Mesh.drain on an observer fed from the wire: events still in flight (sent, not yet seen) and events
    waiting for an answer both keep it waiting; it returns once the last answer arrives."""
    from apiary.mesh import Mesh, MeshOptions

    obs = recorded_observer()
    mesh = Mesh(MeshOptions(results_dir=tmp_path))
    mesh.observer = obs
    mesh.frames_sent = len(obs.events) + 2
    assert mesh.outstanding() == (2, 29) and not mesh.drain(0.3)
    mesh.frames_sent = len(obs.events)
    waiting = [r.event for r in obs.events.values()
               if r.answer is None and f"{r.event.site}/{r.event.device} #{r.event.seq}" in obs.unanswered()]
    assert len(waiting) == 29 and obs.unanswered()[0] == "site-0/hive-0 #10"

    def answer_all() -> None:
        for ev in waiting:
            obs._on_answer("", make(InferenceResult(request_id=f"late-{ev.seq}", site=ev.site, device=ev.device,
                                                    tier="edge", event_seq=ev.seq), sender=ev.device))

    threading.Timer(0.5, answer_all).start()
    assert mesh.drain(30) and mesh.outstanding() == (0, 0) and obs.unanswered() == []
