"""Prometheus metrics: vLLM's names and labels for the engine, ours for the fleet, no percentile gauges."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from apiary.cloud.metrics import TPOT_BUCKETS, TTFT_BUCKETS, FleetCollector, Metrics, reason_rules
from apiary.cloud.store import SqliteStore
from apiary.shared import topics
from apiary.shared.protocol import DeviceState, InferenceResult, OtaStatus, make
from tests.cloud.conftest import MODEL_NAME


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(found: dict, name: str, **labels: str) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


# What LLMEngine.metrics() answers (keys as the engine names them), ngram speculation on.
ENGINE_VALUES = {
    "steps": 40, "requests_finished": 3, "requests_aborted": 1, "prompt_tokens": 120, "generated_tokens": 64,
    "computed_tokens": 150, "prefix_cached_tokens": 32, "prefix_hit_rate": 32 / 120, "kv_slot_waste": 0.1,
    "ttft_mean": 0.2, "ttft_p50": 0.2, "ttft_p99": 0.4, "tpot_mean": 0.05, "tpot_p50": 0.05, "tpot_p99": 0.09,
    "e2e_mean": 1.0, "e2e_p50": None, "e2e_p99": None, "queue_time_p50": 0.01,
    "requests_running": 2, "requests_waiting": 5, "kv_blocks_total": 200, "kv_blocks_used": 50,
    "kv_blocks_free": 150, "kv_blocks_cached_free": 20, "preemptions": 7, "interrupted_steps": 1,
    "spec_method": "ngram", "spec_ngram_proposed": 80, "spec_ngram_accepted": 30, "spec_ngram_verifications": 20,
    "spec_ngram_acceptance_rate": 0.375, "spec_ngram_mean_accepted_length": 1.5,
}


def test_engine_values_are_exported_under_vllm_names_with_model_name():
    m = Metrics()
    m.watch_engine(lambda: dict(ENGINE_VALUES), "bees-1")
    found = samples(m)
    labels = {"model_name": "bees-1", "engine": "0"}
    assert value(found, "vllm:num_requests_running", **labels) == 2
    assert value(found, "vllm:num_requests_waiting", **labels) == 5
    assert value(found, "vllm:kv_cache_usage_perc", **labels) == 0.25
    assert value(found, "vllm:prompt_tokens_total", **labels) == 120
    assert value(found, "vllm:generation_tokens_total", **labels) == 64
    assert value(found, "vllm:num_preemptions_total", **labels) == 7
    assert value(found, "vllm:prefix_cache_queries_total", **labels) == 120
    assert value(found, "vllm:prefix_cache_hits_total", **labels) == 32
    assert value(found, "vllm:spec_decode_num_drafts_total", **labels) == 20
    assert value(found, "vllm:spec_decode_num_draft_tokens_total", **labels) == 80
    assert value(found, "vllm:spec_decode_num_accepted_tokens_total", **labels) == 30
    # the apiary_engine_* gauges the demo reads stay; the engine's windowed percentiles and means do not
    assert value(found, "apiary_engine_kv_blocks_used") == 50
    assert value(found, "apiary_engine_prefix_hit_rate") == pytest.approx(32 / 120)
    names = {name for name, _ in found}
    assert not [n for n in names if n.endswith(("_p50", "_p99", "_mean"))], sorted(names)
    assert "apiary_engine_spec_ngram_mean_accepted_length" in names  # a ratio of counters, not a window


def test_no_speculation_no_spec_series_and_a_failing_read_keeps_the_scrape():
    m = Metrics()
    m.watch_engine(lambda: {k: v for k, v in ENGINE_VALUES.items() if not k.startswith("spec_")}, "bees-1")
    assert not [n for n, _ in samples(m) if n.startswith("vllm:spec_decode")]

    def broken() -> dict:
        raise RuntimeError("engine gone")

    m2 = Metrics()
    m2.watch_engine(broken, "bees-1")
    m2.http_requests.labels(route="/x", method="GET", status="200").inc()
    found = samples(m2)
    assert value(found, "apiary_http_requests_total", route="/x", method="GET", status="200") == 1
    assert not [n for n, _ in found if n.startswith("vllm:num_requests")]


def test_reason_rules_are_bounded_labels_without_values():
    assert reason_rules("low confidence: p10 logprob -2.31 < -1.50; flag swarm_risk, weight_drop is critical") == \
        ["low confidence", "critical flag"]
    assert reason_rules("severity critical is critical (not escalated: battery at 12% is below "
                        "min_soc_for_radio 30%)") == ["critical severity"]
    assert reason_rules("high entropy: 2.10 nats > 1.50; cloud answered expired; local answer used") == \
        ["high entropy", "cloud answered expired", "local answer used"]
    assert reason_rules("low confidence: p10 -3.0 < -1.5; no cloud answer within 300 s") == \
        ["low confidence", "no cloud answer within s"]
    assert reason_rules(None) == [] and reason_rules("") == []


def answer(tier: str, status: str = "ok", reason: str | None = None, site: str = "farm", device: str = "h1"):
    return make(InferenceResult(request_id="r", site=site, device=device, tier=tier, status=status,
                                escalation_reason=reason), sender=device)


def test_fleet_answers_reasons_and_ota_phases_from_the_recorders_messages():
    m = Metrics()
    on = m.observe_fleet_message
    on(topics.answer("farm", "h1"), answer("edge"))
    on(topics.answer("farm", "h1"), answer("edge", reason="low confidence: p10 -3 < -1.5 (not escalated: link is "
                                                          "down and policy link=online_only)"))
    on(topics.answer("farm", "h1"), answer("cloud", reason="flag swarm_risk is critical; low confidence: x"))
    on(topics.answer("farm", "h1"), answer("cloud", status="expired", reason="operator asked for a cloud answer"))
    on(topics.answer("farm", "h2"), answer("cloud", device="h1"))  # speaks for another node: not counted
    ota = OtaStatus(site="farm", device="h1", image_version="2026.12.1", phase="downloading")
    on(topics.ota_status("farm", "h1"), make(ota, sender="h1"))
    on(topics.ota_status("farm", "h1"), make(ota.model_copy(update={"phase": "committed"}), sender="h1"))
    found = samples(m)
    assert value(found, "apiary_answers_total", tier="edge", status="ok") == 2
    assert value(found, "apiary_answers_total", tier="cloud", status="ok") == 1
    assert value(found, "apiary_answers_total", tier="cloud", status="expired") == 1
    assert value(found, "apiary_escalation_reasons_total", reason="low confidence", tier="edge") == 1
    assert value(found, "apiary_escalation_reasons_total", reason="low confidence", tier="cloud") == 1
    assert value(found, "apiary_escalation_reasons_total", reason="critical flag", tier="cloud") == 1
    assert value(found, "apiary_escalation_reasons_total", reason="operator asked for a cloud answer",
                 tier="cloud") == 1
    assert value(found, "apiary_ota_reports_total", phase="downloading") == 1
    assert value(found, "apiary_ota_reports_total", phase="committed") == 1


def test_escalation_reason_labels_are_capped():
    m = Metrics()
    for i in range(40):
        m.observe_fleet_message(topics.answer("farm", "h1"), answer("cloud", reason=f"rule number{'x' * i}: v"))
    reasons = {dict(labels)["reason"] for name, labels in samples(m) if name == "apiary_escalation_reasons_total"}
    assert len(reasons) == 33 and "other" in reasons


def test_device_gauges_come_from_the_store(tmp_path):
    store = SqliteStore(tmp_path / "cloud.db")
    try:
        store.record_state(DeviceState(site="farm", device="h1", status="birth", online=True, session=1,
                                       battery_soc=0.62))
        store.record_state(DeviceState(site="farm", device="h2", status="birth", online=True, session=1))
        store.record_state(DeviceState(site="farm", device="h2", status="death", online=False, session=1))
        store.record_ota_status("e1", OtaStatus(site="farm", device="h1", image_version="v2", phase="verified"))
        m = Metrics()
        m.registry.register(FleetCollector(store.devices))
        found = samples(m)
    finally:
        store.close()
    assert value(found, "apiary_device_battery_soc", site="farm", device="h1") == pytest.approx(0.62)
    assert value(found, "apiary_device_battery_soc", site="farm", device="h2") is None  # none reported
    assert value(found, "apiary_device_online", site="farm", device="h1", role="edge") == 1
    assert value(found, "apiary_device_online", site="farm", device="h2", role="edge") == 0
    assert value(found, "apiary_devices_ota_phase", phase="verified") == 1


def test_vllm_buckets_are_vllms():
    from apiary.cloud.metrics import length_buckets

    assert length_buckets(100) == [1, 2, 5, 10, 20, 50, 100] and length_buckets(2048)[-1] == 2000
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert TPOT_BUCKETS[0] == 0.01 and TPOT_BUCKETS[-1] == 80.0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_real_requests_fill_the_vllm_histograms(make_service, keys, cloud_engine, idle_engine):
    """REST requests through the running service land in vLLM's histograms and counters, labelled with the
    served model's name; the counters are the engine's own."""
    service = make_service()
    key = keys.create(["inference"])

    def scrape() -> dict:
        text = httpx.get(f"{service.url}/metrics", timeout=30).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    labels = {"model_name": MODEL_NAME, "engine": "0"}
    with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        for prompt in ("Bees make", "The hive is"):
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4,
                                                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
    found = scrape()
    engine = cloud_engine.metrics()
    assert value(found, "vllm:time_to_first_token_seconds_count", **labels) == 2
    assert value(found, "vllm:e2e_request_latency_seconds_count", **labels) == 2
    assert value(found, "vllm:time_per_output_token_seconds_count", **labels) == 2  # 4 tokens: a TPOT each
    assert value(found, "vllm:request_queue_time_seconds_count", **labels) == 2
    for phase in ("prefill", "decode", "inference"):
        assert value(found, f"vllm:request_{phase}_time_seconds_count", **labels) == 2, phase
    assert value(found, "vllm:request_generation_tokens_sum", **labels) == 8  # 4 tokens each, EOS ignored
    assert value(found, "vllm:request_prompt_tokens_count", **labels) == 2
    assert value(found, "vllm:request_prompt_tokens_bucket", le="+Inf", **labels) == 2
    assert value(found, "vllm:request_success_total", finished_reason="length", **labels) == 2
    assert value(found, "vllm:time_to_first_token_seconds_bucket", le="+Inf", **labels) == 2
    assert value(found, "vllm:e2e_request_latency_seconds_sum", **labels) >= \
        value(found, "vllm:time_to_first_token_seconds_sum", **labels) > 0
    assert value(found, "vllm:generation_tokens_total", **labels) == engine["generated_tokens"]
    assert value(found, "vllm:prompt_tokens_total", **labels) == engine["prompt_tokens"]
    assert value(found, "vllm:num_requests_running", **labels) == 0
    assert 0 <= value(found, "vllm:kv_cache_usage_perc", **labels) <= 1
    assert not [n for n, _ in found if n.endswith(("_p50", "_p99"))]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_abandoned_stream_is_still_aborted_through_the_observed_engine(make_service, cloud_engine, idle_engine):
    """The observing wrapper closes the engine's stream when its consumer leaves: the request is aborted (its KV
    blocks freed) and lands in no latency histogram."""
    from apiary.cloud.engine import SamplingParams

    service = make_service()
    served = service.app.state.ctx.engine
    assert served is not cloud_engine and served.max_model_len == cloud_engine.max_model_len
    before = cloud_engine.metrics()["requests_aborted"]

    async def leave_early() -> None:
        stream = served.stream("1, 2, 3, 4, 5,", params=SamplingParams(max_tokens=200, temperature=0,
                                                                         ignore_eos=True))
        async for out in stream:
            if out.output_token_ids:
                break
        await stream.aclose()

    asyncio.run(leave_early())
    end = time.monotonic() + 30
    while cloud_engine.metrics()["requests_aborted"] == before and time.monotonic() < end:
        time.sleep(0.05)
    assert cloud_engine.metrics()["requests_aborted"] == before + 1
    found = samples(service.metrics)
    assert value(found, "vllm:time_to_first_token_seconds_count", model_name=MODEL_NAME, engine="0") is None


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_running_service_counts_what_its_recorder_sees(make_service, mosquitto):
    """Over a real broker: a device's birth with its battery, an edge answer and an OTA report reach the service's
    /metrics (counted off the recorder's subscriptions, the battery from the store it wrote)."""
    from apiary.shared.transport import MqttTransport

    service = make_service(broker=mosquitto.config.url, worker_id="metrics-w", escalations=False)
    device = MqttTransport(mosquitto.config, "h7", persistent=False)
    device.start()
    try:
        device.publish(topics.state("farm", "h7"), make(DeviceState(site="farm", device="h7", status="birth",
                                                                    online=True, session=1, battery_soc=0.41),
                                                        sender="h7"))
        device.publish(topics.answer("farm", "h7"), answer("edge", reason="low confidence: p10 -2 < -1.5 (not "
                                                                          "escalated: link is down)", device="h7"))
        device.publish(topics.ota_status("farm", "h7"),
                       make(OtaStatus(site="farm", device="h7", image_version="v3", phase="installed"), sender="h7"))

        def scrape() -> dict:
            text = httpx.get(f"{service.url}/metrics", timeout=30).text
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for f in text_string_to_metric_families(text) for s in f.samples}

        end = time.monotonic() + 60
        found = scrape()
        while value(found, "apiary_devices_ota_phase", phase="installed") is None or \
                value(found, "apiary_answers_total", tier="edge", status="ok") is None:
            assert time.monotonic() < end, sorted(n for n, _ in found if n.startswith("apiary_"))
            time.sleep(0.1)
            found = scrape()
    finally:
        device.stop()
    assert value(found, "apiary_answers_total", tier="edge", status="ok") == 1
    assert value(found, "apiary_escalation_reasons_total", reason="low confidence", tier="edge") == 1
    assert value(found, "apiary_ota_reports_total", phase="installed") == 1
    assert value(found, "apiary_device_battery_soc", site="farm", device="h7") == pytest.approx(0.41)
    assert value(found, "apiary_device_online", site="farm", device="h7", role="edge") == 1
