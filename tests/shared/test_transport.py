"""MqttTransport against real brokers: Mosquitto from the shipped config, and the embedded amqtt."""
from __future__ import annotations

import datetime as dt
import ipaddress
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import paho.mqtt.client as paho
import pytest

from apiary.shared import topics
from apiary.shared.brokers import AUTH_CONFIG, TLS_CONFIG, MosquittoBroker, free_port, make_password_file
from apiary.shared.config import MqttConfig
from apiary.shared.protocol import (ChatMessage, DeviceState, EdgeAttempt, Envelope, InferenceRequest, InferenceResult,
                             OtaCommand, OtaStatus, ProtocolError, SensorEvent, Severity, encode, make)
from apiary.shared.transport import MqttTransport, RecentIds, TransportError
from tests.shared.faulty_link import Fault, FaultyLink
from tests.shared.helpers import Inbox, device_with_will, wait_until

pytestmark = pytest.mark.timeout(90)

SITE = "apiary-north"


# ---------------------------------------------------------------------------- helpers

def event(seq: int, device: str = "hive-01", site: str = SITE) -> Envelope:
    body = SensorEvent(site=site, device=device, seq=seq, timestamp=1.7e9 + seq, readings={"hive_temp_c": 34.5})
    return make(body, sender=device)


def request_body(rid: str, device: str = "hive-01") -> InferenceRequest:
    return InferenceRequest(request_id=rid, site=SITE, device=device, max_tokens=16,
                            messages=[ChatMessage(role="user", content=f"why is the hive loud? ({rid})")])


@pytest.fixture
def connect() -> Iterator[Callable[..., MqttTransport]]:
    """Start transports that are stopped at teardown, whatever the test did."""
    made: list[MqttTransport] = []

    def _connect(config: MqttConfig, client_id: str, *, start: bool = True, **kw) -> MqttTransport:
        t = MqttTransport(config, client_id, **kw)
        made.append(t)
        return t.start(10) if start else t

    yield _connect
    for t in made:
        t.stop(flush_timeout=0)


@pytest.fixture(params=["mosquitto", "embedded_broker"])
def broker(request):
    """Each test using this runs on real Mosquitto and on the embedded amqtt broker."""
    return request.getfixturevalue(request.param)


# ---------------------------------------------------------------------------- units (no broker)

def test_recent_ids_remembers_and_stays_bounded() -> None:
    recent = RecentIds(size=3)
    assert [recent.seen(x) for x in "abca"] == [False, False, False, True]
    recent.seen("d")  # evicts the least recently seen: "b"
    assert len(recent) == 3
    assert recent.seen("b") is False and recent.seen("a") is True


def test_misuse_raises_transport_error() -> None:
    cfg = MqttConfig(port=free_port())
    with pytest.raises(TransportError):
        MqttTransport(cfg, "")
    with pytest.raises(TransportError):
        MqttTransport(cfg, "bad/id")
    t = MqttTransport(cfg, "edge-1")
    with pytest.raises(TransportError, match="not started"):
        t.publish(topics.event(SITE, "hive-01"), event(1))
    with pytest.raises(TransportError):
        t.subscribe("", lambda *_: None)
    with pytest.raises(TransportError, match="reply_to"):
        t.reply(event(1), InferenceResult(request_id="r", site=SITE, device="hive-01", tier="cloud"))


def test_start_without_broker_fails_within_timeout() -> None:
    t = MqttTransport(MqttConfig(port=free_port(), reconnect_min_s=0.05), "edge-1")
    with pytest.raises(TransportError, match="could not connect .* within 1.0s .*ConnectionRefused"):
        t.start(timeout=1.0)
    assert not t.connected
    with pytest.raises(TransportError, match="not started"):
        t.publish(topics.event(SITE, "hive-01"), event(1))


def test_a_refused_broker_is_reported_at_the_first_attempt_with_the_retry_policy(monkeypatch, caplog) -> None:
    """Not seconds of silence: the first refusal is logged at once, saying how long it keeps trying, and only once."""
    import logging

    t = MqttTransport(MqttConfig(port=free_port(), reconnect_min_s=0.05), "edge-1")
    order: list[str] = []
    attempt = t._attempt
    monkeypatch.setattr(t, "_attempt", lambda *a: order.append("attempt") or attempt(*a))
    handler = logging.Handler()
    handler.emit = lambda record: order.append(record.getMessage())
    logging.getLogger("apiary.shared.transport").addHandler(handler)
    try:
        with pytest.raises(TransportError, match="ConnectionRefused"):
            t.start(timeout=1.0)
    finally:
        logging.getLogger("apiary.shared.transport").removeHandler(handler)
    reports = [line for line in order if line != "attempt"]
    assert order.count("attempt") > 2 and order[0] == "attempt" and order[1] == reports[0], order
    assert len(reports) == 1 and "ConnectionRefused" in reports[0], reports
    assert "retrying every 0.05 s for up to 1 s" in reports[0], reports


# ---------------------------------------------------------------------------- both brokers

def all_types() -> list[tuple[str, Envelope]]:
    ev = SensorEvent(site=SITE, device="hive-01", seq=7, timestamp=1.7e9, readings={"weight_kg": 41.2},
                     severity=Severity.WARNING, flags=["weight_drop"])
    bodies = [
        (topics.event(SITE, "hive-01"), ev),
        (topics.escalate(SITE, "hive-01"), InferenceRequest(
            request_id="r-1", site=SITE, device="hive-01", event=ev, priority=3, deadline=1.7e9 + 30,
            edge_attempt=EdgeAttempt(text="swarming?", confidence=-2.5, completion_tokens=9))),
        (topics.answer(SITE, "hive-01"), InferenceResult(
            request_id="r-1", site=SITE, device="hive-01", tier="cloud", text="check the queen", prompt_tokens=80,
            completion_tokens=12, latency_ms=950.0)),
        (topics.state(SITE, "hive-01"), DeviceState(site=SITE, device="hive-01", status="birth", online=True,
                                                     session=3, battery_soc=0.8)),
        (topics.ota_command(SITE, "hive-01"), OtaCommand(site=SITE, device="hive-01", image_version="1.2.0",
                                                         url="http://127.0.0.1/img", sha256="ab" * 32,
                                                         signature="cd" * 64, size=1024)),
        (topics.ota_status(SITE, "hive-01"), OtaStatus(site=SITE, device="hive-01", image_version="1.2.0",
                                                       phase="verified", progress=1.0)),
    ]
    return [(topic, make(body, sender="tester")) for topic, body in bodies]


def test_pubsub_qos1_every_message_type(broker, connect) -> None:
    inbox = Inbox()
    sub = connect(broker.config, "sub-all")
    sub.subscribe(f"{topics.ROOT}/#", inbox)
    pub = connect(broker.config, "pub-all")
    sent = all_types()
    for topic, env in sent:
        assert pub.publish(topic, env, timeout=10)
    got = inbox.wait(len(sent))
    assert [(t, e.id) for t, e in inbox.items] == [(t, e.id) for t, e in sent]
    assert [e.body for e in got] == [e.body for _, e in sent]
    assert pub.stats["acked"] == len(sent) and sub.stats["decode_errors"] == 0


def test_protocol_negotiation(broker, connect) -> None:
    t = connect(broker.config, "probe")
    if isinstance(broker, MosquittoBroker):
        assert (t.protocol, t.shared_subscriptions) == ("5", True)
        legacy = connect(broker.config.model_copy(update={"protocol": "3.1.1"}), "probe-311")
        assert legacy.protocol == "3.1.1"
    else:  # amqtt refuses MQTT 5 and has no $share: the transport falls back and says so
        assert (t.protocol, t.shared_subscriptions) == ("3.1.1", False)


def test_request_response_with_correlation(broker, connect) -> None:
    """Edge asks, a cloud worker on the shared escalation filter answers; replies find their request."""
    worker = connect(broker.config, "cloud-worker-1")
    served: list[str] = []

    def answer(topic: str, env: Envelope) -> None:
        req = env.body
        served.append(req.request_id)
        worker.reply(env, InferenceResult(request_id=req.request_id, site=req.site, device=req.device,
                                          tier="cloud", text=f"answer to {req.request_id}"))

    worker.subscribe(topics.escalations_shared(), answer)
    edge = connect(broker.config, "edge-hive-01")
    reply_topic = topics.reply(SITE, "hive-01")

    replies: dict[str, Envelope] = {}
    errors: list[BaseException] = []

    def ask(rid: str) -> None:
        try:
            replies[rid] = edge.request(topics.escalate(SITE, "hive-01"), request_body(rid), reply_topic=reply_topic,
                                        timeout=15)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(f"req-{i}",)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors
    assert sorted(served) == sorted(replies) == [f"req-{i}" for i in range(4)]
    for rid, rep in replies.items():
        assert rep.body.request_id == rid and rep.body.text == f"answer to {rid}"
        assert rep.correlation_id is not None and rep.reply_to is None and rep.sender == "cloud-worker-1"
    assert len({r.correlation_id for r in replies.values()}) == 4

    # An explicit envelope keeps its own correlation id.
    env = make(request_body("req-explicit"), sender="edge-hive-01", correlation_id="corr-42")
    assert edge.request(topics.escalate(SITE, "hive-01"), env, reply_topic=reply_topic,
                        timeout=15).correlation_id == "corr-42"

    # Nobody serves this topic: a clean TimeoutError, and the pending slot is released.
    with pytest.raises(TimeoutError):
        edge.request(topics.ota_command(SITE, "hive-01"), request_body("req-void"), reply_topic=reply_topic,
                     timeout=0.5)
    assert not edge._pending


def test_offline_persistent_subscriber_gets_messages_on_return(broker, connect) -> None:
    first = connect(broker.config, "edge-hive-07")
    first.subscribe(topics.event(SITE, "hive-07"), Inbox())
    first.stop()  # clean disconnect; the session (and its subscription) stays on the broker

    pub = connect(broker.config, "bridge-1")
    sent = [event(i, device="hive-07") for i in range(300)]
    for env in sent:
        assert pub.publish(topics.event(SITE, "hive-07"), env)
    assert pub.publish(topics.event(SITE, "hive-07"), event(300, device="hive-07"), timeout=15)
    wait_until(lambda: pub.stats["acked"] == 301, what="all acknowledged")

    inbox = Inbox()
    back = connect(broker.config, "edge-hive-07", start=False)
    back.subscribe(topics.event(SITE, "hive-07"), inbox)
    back.start(10)
    got = [e.body.seq for e in inbox.wait(301)]
    assert sorted(got) == list(range(301))
    if isinstance(broker, MosquittoBroker):
        assert got == list(range(301))  # Mosquitto also keeps the order


# ---------------------------------------------------------------------------- subscriptions across reconnects

FAST = {"reconnect_min_s": 0.05, "reconnect_max_s": 0.2}

# Each breaks the connect/subscribe sequence at one point; the same faults hit the first connect
# (a fresh persistent session) and a reconnect into a session the broker resumes.
SEQUENCE_FAULTS = {
    "connack-lost": [Fault("CONNACK", "cut_before")],
    "link-lost-right-after-connack": [Fault("CONNACK", "cut_after")],
    "subscribe-lost": [Fault("SUBSCRIBE", "cut_before")],
    "suback-lost": [Fault("SUBACK", "cut_before")],
    "subscription-refused-once": [Fault("SUBACK", "refuse")],
    "twice-in-a-row": [Fault("CONNACK", "cut_after"), Fault("SUBSCRIBE", "cut_before")],
}


@pytest.fixture
def faulty_link() -> Iterator[Callable[[MqttConfig], FaultyLink]]:
    made: list[FaultyLink] = []

    def _make(upstream: MqttConfig) -> FaultyLink:
        made.append(FaultyLink(upstream.model_copy(update=FAST)))
        return made[-1]

    yield _make
    for link in made:
        link.close()


def restart(broker) -> None:
    """Mosquitto keeps its persistent sessions across a restart; the embedded amqtt forgets them."""
    broker.stop()
    broker.start()


def granted_again(link: FaultyLink) -> None:
    """Every armed fault happened, and the broker then granted the subscription on a live connection."""
    wait_until(lambda: link.armed == 0 and link.granted_on_latest() >= 1, timeout=15,
               what="the subscription granted again after the fault")


def delivered(pub: MqttTransport, inbox: Inbox, seq: int, device: str) -> None:
    """An event published now reaches the subscriber."""
    wait_until(lambda: pub.connected, what="the publisher's link")
    assert pub.publish(topics.event(SITE, device), event(seq, device=device), timeout=10)
    wait_until(lambda: seq in [e.body.seq for e in inbox.envs], timeout=15, what=f"event {seq} at the subscriber")


@pytest.mark.parametrize("faults", SEQUENCE_FAULTS.values(), ids=SEQUENCE_FAULTS.keys())
def test_subscriptions_survive_a_link_lost_at_any_point_of_connect_and_subscribe(broker, connect, faulty_link,
                                                                                 faults) -> None:
    link = faulty_link(broker.config)
    inbox = Inbox()
    sub = connect(link.config, "edge-hive-05", start=False)
    sub.subscribe(topics.event(SITE, "hive-05"), inbox)
    pub = connect(broker.config, "bridge-5")

    link.arm(*faults)
    sub.start(10)  # the first connect of a fresh persistent session
    granted_again(link)
    delivered(pub, inbox, 1, "hive-05")

    link.arm(*faults)
    link.drop()  # a reconnect into the session the broker kept
    granted_again(link)
    assert link.session_present[-1] is True, "the broker resumed the session: the case that skipped re-subscribing"
    delivered(pub, inbox, 2, "hive-05")
    assert sub.subscribed and sub.stats["reconnects"] >= 1
    if faults[0].action == "refuse":
        assert sub.stats["subscribe_refused"] == 2  # logged and retried, once per phase


def test_subscriptions_survive_broker_restarts_mid_subscribe(broker, connect, faulty_link) -> None:
    """The broker goes down while the SUBSCRIBE is in flight (it never processed it), then once more later."""
    link = faulty_link(broker.config)
    inbox = Inbox()
    sub = connect(link.config, "edge-hive-06", start=False)
    sub.subscribe(topics.event(SITE, "hive-06"), inbox)
    link.arm(Fault("SUBSCRIBE", "swallow"))
    sub.start(10)
    wait_until(lambda: link.armed == 0, what="the SUBSCRIBE to be lost")
    assert not sub.subscribed  # no SUBACK: not active, whatever the connection says
    restart(broker)
    granted_again(link)
    pub = connect(broker.config.model_copy(update=FAST), "bridge-6")
    delivered(pub, inbox, 1, "hive-06")

    reconnects = sub.stats["reconnects"]
    restart(broker)
    wait_until(lambda: sub.stats["reconnects"] > reconnects, what="the subscriber to reconnect")
    assert sub.wait_subscribed(15)
    delivered(pub, inbox, 2, "hive-06")


def test_resubscribing_a_resumed_session_does_not_replay_retained_messages(mosquitto, connect, faulty_link) -> None:
    """MQTT 5 Retain Handling 1: a handler that opted out of de-duplication sees a retained state once."""
    link = faulty_link(mosquitto.config)
    pub = connect(mosquitto.config, "edge-hive-08")
    birth = make(DeviceState(site=SITE, device="hive-08", status="birth", online=True, session=1), sender="edge-hive-08")
    assert pub.publish(topics.state(SITE, "hive-08"), birth, retain=True, timeout=10)
    states = Inbox()
    cloud = connect(link.config, "cloud-fleet")
    cloud.subscribe(topics.all_of("state"), states, dedup=False)
    assert [e.id for e in states.wait(1)] == [birth.id]
    # A publish acknowledged on the same link: the broker has our PUBACK of the birth (no QoS 1 redelivery).
    assert cloud.publish(topics.event(SITE, "hive-08"), event(1, device="hive-08"), timeout=10)
    link.drop()
    granted_again(link)
    update = make(DeviceState(site=SITE, device="hive-08", status="update", online=True, session=1),
                  sender="edge-hive-08")
    assert pub.publish(topics.state(SITE, "hive-08"), update, timeout=10)  # after any replay of this SUBSCRIBE
    wait_until(lambda: update.id in [e.id for e in states.envs], what="the update")
    assert cloud.protocol == "5" and [e.id for e in states.envs] == [birth.id, update.id]


def test_subscribe_while_connected_outlasts_a_lost_subscribe_and_raises_on_refusal(broker, connect,
                                                                                    faulty_link) -> None:
    link = faulty_link(broker.config)
    sub = connect(link.config, "edge-hive-07")
    pub = connect(broker.config, "bridge-7")
    inbox = Inbox()
    link.arm(Fault("SUBSCRIBE", "cut_before"))
    sub.subscribe(topics.event(SITE, "hive-07"), inbox, timeout=15)  # returns once the reconnect granted it
    assert sub.subscribed and link.granted_on_latest() == 1
    delivered(pub, inbox, 1, "hive-07")

    link.arm(Fault("SUBACK", "refuse"))
    with pytest.raises(TransportError, match="refused subscription to"):
        sub.subscribe(topics.all_of("event"), Inbox())
    assert sub.subscribed, "a subscription refused to its caller is forgotten, not retried"


# ---------------------------------------------------------------------------- Mosquitto only

def test_mqtt5_properties_mirror_the_envelope(mosquitto, connect) -> None:
    seen: list[paho.MQTTMessage] = []
    raw = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="raw-v5", protocol=paho.MQTTv5)
    raw.on_message = lambda c, u, m: seen.append(m)
    raw.connect(mosquitto.host, mosquitto.port)
    raw.loop_start()
    try:
        rc, mid = raw.subscribe(topics.all_of("escalate"), qos=1)
        time.sleep(0.2)  # raw paho: give the SUBACK a moment (our transport waits for it properly)
        edge = connect(mosquitto.config, "edge-props")
        env = make(request_body("req-p"), sender="edge-props", reply_to=topics.reply(SITE, "hive-01"),
                   correlation_id="corr-p")
        assert edge.publish(topics.escalate(SITE, "hive-01"), env, timeout=10)
        wait_until(lambda: len(seen) == 1)
        props = seen[0].properties
        assert props.ResponseTopic == topics.reply(SITE, "hive-01")
        assert props.CorrelationData == b"corr-p"
    finally:
        raw.disconnect()
        raw.loop_stop()


def test_burst_of_5000_complete_in_order_and_deduplicated(mosquitto, connect) -> None:
    """Two publishers, 2,500 QoS 1 messages each, every tenth sent twice (same envelope id)."""
    inbox = Inbox()
    sub = connect(mosquitto.config, "cloud-recorder")
    sub.subscribe(topics.all_of("event"), inbox)
    pubs = [connect(mosquitto.config, f"bridge-{n}") for n in range(2)]
    per_pub = 2500

    def run(pub: MqttTransport, device: str) -> None:
        for i in range(per_pub):
            env = event(i, device=device)
            assert pub.publish(topics.event(SITE, device), env)
            if i % 10 == 0:
                assert pub.publish(topics.event(SITE, device), env)  # a redelivery, as QoS 1 allows

    threads = [threading.Thread(target=run, args=(p, f"hive-{n}")) for n, p in enumerate(pubs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    got = inbox.wait(2 * per_pub, timeout=60)
    wait_until(lambda: sub.stats["received"] == 2 * per_pub + 2 * per_pub // 10, what="the duplicates")
    assert len(got) == 2 * per_pub
    assert len({e.id for e in got}) == 2 * per_pub
    for n in range(2):
        seqs = [e.body.seq for e in got if e.body.device == f"hive-{n}"]
        assert seqs == list(range(per_pub)), f"publisher {n} out of order or incomplete"
    assert sub.stats["duplicates"] == 2 * per_pub // 10
    assert all(p.stats["acked"] == p.stats["published"] for p in pubs)


def test_broker_restart_mid_stream_loses_nothing_acknowledged(mosquitto, connect) -> None:
    """Publisher streams 3,000 events while the subscriber goes offline and Mosquitto restarts.

    Mosquitto's persistence keeps the session, its subscription and every queued message;
    paho resends what was in flight; what the link refused, the publisher's outbox resends.
    """
    total = 3000
    first_inbox = Inbox()
    sub = connect(mosquitto.config, "cloud-recorder")
    sub.subscribe(topics.all_of("event"), first_inbox)

    pub = connect(mosquitto.config, "bridge-1")
    link: list[bool] = []
    link_up = threading.Event()
    link_up.set()

    def on_link(up: bool) -> None:
        link.append(up)
        (link_up.set if up else link_up.clear)()

    pub.add_link_listener(on_link)
    sent = threading.Event()
    progress = [0]

    def stream() -> None:
        for i in range(total):
            env = event(i)
            while not pub.publish(topics.event(SITE, "hive-01"), env):  # the outbox: hold it until the link is back
                link_up.wait(1)
            progress[0] = i + 1
            if i % 100 == 0:
                time.sleep(0.01)
        sent.set()

    th = threading.Thread(target=stream)
    th.start()
    wait_until(lambda: len(first_inbox.items) >= 500, what="first messages")
    sub.stop()  # subscriber offline: the broker queues for it from here on
    wait_until(lambda: progress[0] >= 1500, what="publisher progress")
    mosquitto.restart()  # SIGTERM: the database is written; same port and data dir
    th.join(60)
    assert sent.is_set()
    wait_until(lambda: pub.stats["acked"] == pub.stats["published"], timeout=30, what="every publish acknowledged")
    assert False in link and link[-1] is True and pub.stats["reconnects"] >= 1

    second_inbox = Inbox()
    back = connect(mosquitto.config, "cloud-recorder", start=False)
    back.subscribe(topics.all_of("event"), second_inbox)
    back.start(10)
    wait_until(lambda: {e.body.seq for e in first_inbox.envs + second_inbox.envs} == set(range(total)),
               timeout=30, what="every event after the restart")
    stream_seqs = [e.body.seq for e in first_inbox.envs + second_inbox.envs]
    first_seen = list(dict.fromkeys(stream_seqs))
    assert first_seen == list(range(total)), "order per publisher broken across the restart"


def test_subscription_made_during_an_outage_reaches_the_resumed_session(mosquitto, connect) -> None:
    cfg = mosquitto.config.model_copy(update={"reconnect_min_s": 0.05, "reconnect_max_s": 0.2})
    events, answers = Inbox(), Inbox()
    cloud = connect(cfg, "cloud-recorder")
    cloud.subscribe(topics.all_of("event"), events)
    mosquitto.stop()
    wait_until(lambda: not cloud.connected, what="the link to drop")
    cloud.subscribe(topics.all_of("answer"), answers)  # the broker is down: remembered, sent on reconnect
    mosquitto.start()
    wait_until(lambda: cloud.connected, what="reconnect")
    edge = connect(cfg, "edge-hive-01")
    result = make(InferenceResult(request_id="r", site=SITE, device="hive-01", tier="edge"), sender="edge-hive-01")
    assert edge.publish(topics.event(SITE, "hive-01"), event(1), timeout=10)
    assert edge.publish(topics.answer(SITE, "hive-01"), result, timeout=10)
    assert events.wait(1)[0].body.seq == 1, "the old subscription came back with the persisted session"
    assert answers.wait(1)[0].id == result.id, "the new subscription was sent although the session was resumed"
    assert cloud.stats["reconnects"] == 1


def test_shared_subscription_splits_without_loss_or_doubles(mosquitto, connect) -> None:
    inboxes = [Inbox(), Inbox()]
    for n, inbox in enumerate(inboxes):
        connect(mosquitto.config, f"cloud-worker-{n}").subscribe(topics.escalations_shared("workers"), inbox)
    edge = connect(mosquitto.config, "edge-hive-01")
    n_msgs = 600
    for i in range(n_msgs):
        assert edge.publish(topics.escalate(SITE, "hive-01"), make(request_body(f"r{i}"), sender="edge-hive-01"))
    wait_until(lambda: sum(len(b.items) for b in inboxes) >= n_msgs, what="all escalations")
    time.sleep(0.3)  # a doubled delivery would arrive right behind the last one
    ids = [[e.body.request_id for e in b.envs] for b in inboxes]
    assert len(ids[0]) > 0 and len(ids[1]) > 0, "both workers get a share"
    assert not set(ids[0]) & set(ids[1])
    assert sorted(ids[0] + ids[1]) == sorted(f"r{i}" for i in range(n_msgs))


def test_undecodable_payloads_and_failing_handlers_never_stop_delivery(mosquitto, connect) -> None:
    good, calls = Inbox(), []

    def broken(topic: str, env: Envelope) -> None:
        calls.append(env.id)
        raise RuntimeError("handler bug")

    sub = connect(mosquitto.config, "cloud-recorder")
    sub.subscribe(topics.all_of("event"), broken)
    sub.subscribe(topics.all_of("event"), good)
    raw = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="raw-garbage")
    raw.connect(mosquitto.host, mosquitto.port)
    raw.loop_start()
    try:
        topic = topics.event(SITE, "hive-01")
        for payload in (b"\x00not msgpack", b"\x81\xa1v\x63", encode(event(1))):
            raw.publish(topic, payload, qos=1).wait_for_publish(5)
    finally:
        raw.disconnect()
        raw.loop_stop()
    assert [e.body.seq for e in good.wait(1)] == [1]
    assert len(calls) == 1
    assert sub.stats["decode_errors"] == 2 and sub.stats["handler_errors"] == 1
    assert sub.connected


def test_oversize_envelope_is_refused_before_sending(mosquitto, connect) -> None:
    t = connect(mosquitto.config.model_copy(update={"max_payload": 1024}), "edge-big")
    big = make(SensorEvent(site=SITE, device="hive-01", seq=1, timestamp=1.0,
                           readings={f"r{i}": float(i) for i in range(200)}), sender="edge-big")
    with pytest.raises(ProtocolError, match="over the 1024-byte limit"):
        t.publish(topics.event(SITE, "hive-01"), big)
    assert t.stats["published"] == 0


def test_last_will_marks_a_vanished_device_dead(mosquitto, connect) -> None:
    states = Inbox()
    watcher = connect(mosquitto.config, "cloud-watcher")
    watcher.subscribe(topics.all_of("state"), states)
    with device_with_will(mosquitto.config, SITE, "hive-09", session=1) as proc:
        wait_until(lambda: [e.body.status for e in states.envs] == ["birth"], what="birth")
        proc.kill()  # power cut: no DISCONNECT, so the broker publishes the Last Will
        proc.wait(10)
        wait_until(lambda: [e.body.status for e in states.envs] == ["birth", "death"], what="death certificate")
    late = Inbox()  # the death is retained: a late observer learns it too
    connect(mosquitto.config, "late-watcher", persistent=False).subscribe(topics.state(SITE, "hive-09"), late)
    assert late.wait(1)[0].body.status == "death"


# ---------------------------------------------------------------------------- auth, ACLs, TLS

USERS = {"cloud": "cloud-secret", "hive-01": "pw-hive-01", "hive-02": "pw-hive-02"}


def secured_broker(tmp_path: Path, template: Path = AUTH_CONFIG, **variables: str) -> MosquittoBroker:
    passwd = make_password_file(tmp_path / "passwd", USERS)
    broker = MosquittoBroker(data_dir=tmp_path / "mosquitto", config=template,
                             variables={"password_file": str(passwd), **variables})
    broker.start()
    return broker


def creds(broker: MosquittoBroker, user: str, password: str | None = None, **kw) -> MqttConfig:
    return broker.config.model_copy(update={"username": user, "password": password or USERS[user], **kw})


@pytest.mark.parametrize("protocol", ["auto", "3.1.1"])
def test_acl_device_cannot_publish_as_another_device(tmp_path, connect, protocol) -> None:
    broker = secured_broker(tmp_path)
    try:
        seen = Inbox()
        connect(creds(broker, "cloud"), "cloud-recorder").subscribe("apiary/#", seen)
        hive1 = connect(creds(broker, "hive-01", protocol=protocol), "hive-01")
        forged = event(1, device="hive-02")
        accepted = hive1.publish(topics.event(SITE, "hive-02"), forged, timeout=10)
        if hive1.protocol == "5":
            assert accepted is False  # MQTT 5 PUBACK carries "Not authorized"
        own = event(2, device="hive-01")
        assert hive1.publish(topics.event(SITE, "hive-01"), own, timeout=10)
        got = seen.wait(1)
        time.sleep(0.2)  # the forged message went first on the same connection; it would be here by now
        assert [e.id for e in seen.envs] == [own.id], "the forged message reached the cloud"
        assert got[0].body.device == "hive-01"

        # Reading is confined the same way: Mosquitto accepts the subscription but never
        # delivers another device's messages to it.
        snooped = Inbox()
        hive1.subscribe(topics.all_of("event"), snooped)
        cloud_pub = connect(creds(broker, "cloud"), "cloud-ops")
        other, mine = event(3, device="hive-02"), event(4, device="hive-01")
        assert cloud_pub.publish(topics.event(SITE, "hive-02"), other, timeout=10)
        assert cloud_pub.publish(topics.event(SITE, "hive-01"), mine, timeout=10)
        snooped.wait(1)
        time.sleep(0.2)
        assert [e.id for e in snooped.envs] == [mine.id]
    finally:
        broker.close()


def test_wrong_password_and_unknown_user_are_refused(tmp_path) -> None:
    broker = secured_broker(tmp_path)
    try:
        for cfg in (creds(broker, "hive-01", "wrong"), creds(broker, "nobody", "x"), broker.config):
            t = MqttTransport(cfg, "intruder")
            # A refusal is final ("refused client"), not retried until the timeout ("could not connect").
            with pytest.raises(TransportError, match="refused client 'intruder': (Not authorized|Bad user name)"):
                t.start(timeout=10)
            assert not t.connected
    finally:
        broker.close()


def make_tls_material(directory: Path) -> dict[str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1 (cryptography, no openssl CLI)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    now = dt.datetime.now(dt.timezone.utc)
    out: dict[str, str] = {}
    for label in ("ca", "other_ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(label)).issuer_name(name(label))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        (directory / f"{label}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[label] = str(directory / f"{label}.crt")
        if label == "ca":
            ca_key, ca_cert = key, cert
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = (x509.CertificateBuilder().subject_name(name("127.0.0.1")).issuer_name(ca_cert.subject)
              .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
              .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                          x509.DNSName("localhost")]), critical=False)
              .sign(ca_key, hashes.SHA256()))
    (directory / "server.crt").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    (directory / "server.key").write_bytes(pem_key(server_key))
    (directory / "server.key").chmod(0o600)
    out.update(server_crt=str(directory / "server.crt"), server_key=str(directory / "server.key"))
    return out


def test_tls_with_password(tmp_path, connect) -> None:
    tls = make_tls_material(tmp_path)
    broker = secured_broker(tmp_path, TLS_CONFIG, cafile=tls["ca"], certfile=tls["server_crt"],
                            keyfile=tls["server_key"])
    try:
        inbox = Inbox()
        connect(creds(broker, "cloud", tls=True, ca_file=tls["ca"]), "cloud-recorder").subscribe("apiary/#", inbox)
        hive = connect(creds(broker, "hive-01", tls=True, ca_file=tls["ca"]), "hive-01")
        assert hive.publish(topics.event(SITE, "hive-01"), event(5), timeout=10)
        assert inbox.wait(1)[0].body.seq == 5
        for cfg in (creds(broker, "hive-01", tls=True, ca_file=tls["other_ca"]),  # broker not trusted
                    creds(broker, "hive-01")):  # plaintext to a TLS port
            with pytest.raises(TransportError):
                MqttTransport(cfg, "hive-01-bad").start(timeout=2)
    finally:
        broker.close()


def test_idempotent_handlers_can_opt_out_of_deduplication(mosquitto, connect) -> None:
    """A deliberate re-send of the same envelope (store-and-forward retry) reaches a dedup=False handler."""
    plain, resends = Inbox(), Inbox()
    sub = connect(mosquitto.config, "sub-dedup")
    sub.subscribe(topics.all_of("event"), plain)
    idempotent = connect(mosquitto.config, "sub-no-dedup")
    idempotent.subscribe(topics.all_of("event"), resends, dedup=False)
    pub = connect(mosquitto.config, "pub-dedup")
    env = event(1)
    assert pub.publish(topics.event(SITE, "hive-01"), env, timeout=10)
    assert pub.publish(topics.event(SITE, "hive-01"), env, timeout=10)
    assert pub.publish(topics.event(SITE, "hive-01"), event(2), timeout=10)
    assert [e.body.seq for e in resends.wait(3)] == [1, 1, 2]
    assert [e.body.seq for e in plain.wait(2)] == [1, 2]
    assert sub.stats["duplicates"] == 1 and idempotent.stats["duplicates"] == 1
