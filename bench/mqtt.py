"""MQTT at QoS 1: msgs/s and request/response round-trip p50/p99, Mosquitto vs the embedded broker.

Each broker runs on loopback in this process's machine. Throughput: one publisher sends
``messages`` sensor-event envelopes (about ``payload_bytes`` on the wire) as fast as the
transport takes them; one subscriber receives them through the broker; msgs/s is from the
first publish to the last delivery (the publisher's PUBACK rate is shown too). Round trip:
``round_trips`` sequential ``request()`` calls answered by a responder on the escalation
topic. Brokers are measured interleaved, ``repeats`` times, and the median is reported,
because other work on the same machine makes single runs noisy.
"""
from __future__ import annotations

import typer


def command(
    messages: int = typer.Option(5000, help="QoS 1 messages per throughput run"),
    payload_bytes: int = typer.Option(300, help="approximate encoded envelope size"),
    round_trips: int = typer.Option(500, help="sequential request/response pairs per run"),
    repeats: int = typer.Option(3, help="interleaved runs per broker; the median is reported"),
) -> None:
    import statistics
    import threading
    import time

    from apiary.bench.common import percentile, report
    from apiary.shared import topics
    from apiary.shared.brokers import EmbeddedBroker, MosquittoBroker
    from apiary.shared.protocol import InferenceRequest, InferenceResult, SensorEvent, encode, make
    from apiary.shared.transport import MqttTransport

    site, device = "bench-site", "hive-01"

    def sensor_event(seq: int):
        readings = {"hive_temp_c": 34.5, "ambient_c": 21.0, "humidity": 0.61, "weight_kg": 41.25,
                    "sound_db": 48.0, "battery_v": 3.92}
        body = SensorEvent(site=site, device=device, seq=seq, timestamp=time.time(), readings=readings)
        env = make(body, sender="bench-pub")
        pad = max(0, payload_bytes - len(encode(env)))
        if pad:
            body = body.model_copy(update={"flags": ["x" * max(1, pad - 3)]})
            env = make(body, sender="bench-pub")
        return env

    def throughput(config, tag: str) -> dict[str, float]:
        done = threading.Event()
        got = [0, 0.0]

        def on_msg(topic: str, env) -> None:
            got[0] += 1
            if got[0] == messages:
                got[1] = time.perf_counter()
                done.set()

        sub = MqttTransport(config, f"bench-sub-{tag}", persistent=False).start()
        pub = MqttTransport(config, f"bench-pub-{tag}", persistent=False).start()
        try:
            sub.subscribe(topics.event(site, device), on_msg)
            envs = [sensor_event(i) for i in range(messages)]
            size = len(encode(envs[0]))
            topic = topics.event(site, device)
            t0 = time.perf_counter()
            for env in envs:
                while not pub.publish(topic, env):
                    time.sleep(0.001)
            while pub.stats["acked"] < messages and time.perf_counter() - t0 < 120:
                time.sleep(0.001)
            acked_s = time.perf_counter() - t0
            if not done.wait(120):
                raise RuntimeError(f"{tag}: only {got[0]} of {messages} delivered")
            return {"delivered": messages / (got[1] - t0), "acked": messages / acked_s, "bytes": size}
        finally:
            pub.stop()
            sub.stop()

    def round_trip(config, tag: str) -> list[float]:
        responder = MqttTransport(config, f"bench-cloud-{tag}", persistent=False).start()
        edge = MqttTransport(config, f"bench-edge-{tag}", persistent=False).start()
        try:
            def answer(topic: str, env) -> None:
                req = env.body
                responder.reply(env, InferenceResult(request_id=req.request_id, site=site, device=device,
                                                     tier="cloud", text="ok"))

            responder.subscribe(topics.escalate(site, device), answer)
            reply_topic = topics.reply(site, device)
            edge.request(topics.escalate(site, device), InferenceRequest(request_id="warmup", site=site,
                                                                         device=device, prompt="hi"),
                         reply_topic=reply_topic, timeout=10)
            latencies = []
            for i in range(round_trips):
                body = InferenceRequest(request_id=f"r{i}", site=site, device=device, prompt="how is the hive?")
                t0 = time.perf_counter()
                edge.request(topics.escalate(site, device), body, reply_topic=reply_topic, timeout=10)
                latencies.append((time.perf_counter() - t0) * 1000)
            return latencies
        finally:
            edge.stop()
            responder.stop()

    brokers = {"mosquitto": MosquittoBroker(), "embedded (amqtt)": EmbeddedBroker()}
    results: dict[str, dict[str, list]] = {name: {"delivered": [], "acked": [], "rtt": [], "bytes": []}
                                           for name in brokers}
    protocols: dict[str, str] = {}
    try:
        configs = {name: b.start() for name, b in brokers.items()}
        for run in range(repeats):
            for name, config in configs.items():
                tag = f"{name.split()[0]}-{run}"
                tp = throughput(config, tag)
                results[name]["delivered"].append(tp["delivered"])
                results[name]["acked"].append(tp["acked"])
                results[name]["bytes"].append(tp["bytes"])
                results[name]["rtt"].append(round_trip(config, tag))
        for name, config in configs.items():
            probe = MqttTransport(config, f"bench-probe-{name.split()[0]}", persistent=False).start()
            protocols[name] = probe.protocol or "?"
            probe.stop()
    finally:
        for b in brokers.values():
            b.close()

    columns = ["broker", "MQTT", "messages", "bytes/msg", "delivered msg/s", "acked msg/s", "rtt p50 ms",
               "rtt p99 ms", "round trips"]
    rows = []
    summary: dict[str, dict[str, float]] = {}
    for name, r in results.items():
        p50 = statistics.median(percentile(x, 50) for x in r["rtt"])
        p99 = statistics.median(percentile(x, 99) for x in r["rtt"])
        delivered, acked = statistics.median(r["delivered"]), statistics.median(r["acked"])
        summary[name] = {"delivered_msgs_s": delivered, "acked_msgs_s": acked, "rtt_p50_ms": p50, "rtt_p99_ms": p99}
        rows.append([name, protocols[name], messages, r["bytes"][0], round(delivered), round(acked), p50, p99,
                     round_trips])
    mosq, emb = summary["mosquitto"], summary["embedded (amqtt)"]
    report("mqtt", "MQTT QoS 1 on loopback: Mosquitto vs embedded amqtt (median of interleaved runs)", columns, rows,
           extra={"summary": summary, "repeats": repeats,
                  "throughput_ratio_mosquitto_over_embedded": mosq["delivered_msgs_s"] / emb["delivered_msgs_s"],
                  "rtt_p50_ratio_embedded_over_mosquitto": emb["rtt_p50_ms"] / mosq["rtt_p50_ms"],
                  "raw": {n: {"delivered": r["delivered"], "acked": r["acked"]} for n, r in results.items()},
                  "note": "one machine, broker + clients in one process family; other work may share the CPUs"})
