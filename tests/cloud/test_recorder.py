"""The fleet recorder on the shipped ACL broker, attacked by a device that owns only its own topics.

The broker lets hive-0001 publish anything under ``apiary/v1/+/hive-0001/#``; what the recorder
stores must then speak for hive-0001 alone, follow the Sparkplug session rule, and never crash on
values the store cannot hold. Every "nothing else happened" check waits for a later message from
the same publisher (or, across clients, one published after the first was acknowledged): the
broker delivers them in order, so when the later one is recorded the earlier one was handled.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import pytest

from apiary.cloud.metrics import Metrics
from apiary.cloud.recorder import Recorder
from apiary.cloud.store import SqlStore
from apiary.shared import topics
from apiary.shared.config import MqttConfig
from apiary.shared.protocol import Body, DeviceState, InferenceResult, OtaStatus, SensorEvent, make
from apiary.shared.transport import MqttTransport
from tests.shared.helpers import AclBroker, device_with_will, forged_payload, publish_raw, wait_until

pytestmark = pytest.mark.timeout(120)

SITE = "s1"


class FleetRecorder:
    """A recorder as ``cloud serve`` runs it: the cloud's login, its own metrics, one store."""

    def __init__(self, config: MqttConfig, store: SqlStore, client_id: str) -> None:
        self.metrics = Metrics()
        self.transport = MqttTransport(config, client_id, persistent=False)
        Recorder(store, self.metrics).attach(self.transport)
        self.transport.start(10)
        assert self.transport.wait_subscribed(10)  # else what a test sends first can pass before the SUBACK

    def count(self, kind: str) -> float:
        return self.metrics.registry.get_sample_value("apiary_recorded_messages_total", {"kind": kind}) or 0.0


@pytest.fixture
def store(any_store) -> SqlStore:
    """The recorder's store on SQLite and on PostgreSQL (tests/cloud/conftest.py)."""
    return any_store


@pytest.fixture
def start(acl_mosquitto: AclBroker) -> Iterator[Callable[..., Any]]:
    """``start(user, client_id)`` a transport, ``start(store=..., client_id=...)`` a recorder; all stopped after."""
    made: list[MqttTransport] = []

    def _start(user: str = "cloud", client_id: str = "cloud-recorder", *, store: SqlStore | None = None):
        if store is not None:
            rec = FleetRecorder(acl_mosquitto.login("cloud"), store, client_id)
            made.append(rec.transport)
            return rec
        t = MqttTransport(acl_mosquitto.login(user), client_id, persistent=False).start(10)
        made.append(t)
        return t

    yield _start
    for t in made:
        t.stop(flush_timeout=0)


def send(t: MqttTransport, topic: str, body: Body, *, retain: bool = False) -> None:
    assert t.publish(topic, make(body, sender=t.client_id), retain=retain, timeout=10), f"broker refused {topic}"


def state(device: str, status: str, session: int, site: str = SITE) -> DeviceState:
    return DeviceState(site=site, device=device, status=status, online=status != "death", session=session)


def event(device: str, seq: int) -> SensorEvent:
    return SensorEvent(site=SITE, device=device, seq=seq, timestamp=time.time(), readings={"hive_temp_c": 35.0})


def node(store: SqlStore, device: str) -> dict[str, Any] | None:
    return next((d for d in store.devices(SITE) if d["device"] == device), None)


def recorded_event(store: SqlStore, device: str, seq: int) -> Callable[[], bool]:
    return lambda: any(e["seq"] == seq for e in store.events(SITE, device))


def test_a_device_cannot_record_state_for_another_even_retained(acl_mosquitto, store, start) -> None:
    """hive-0001 declares hive-0002 dead on its own (retained) state topic, with a session no real birth
    reaches: refused when it arrives and again at every recorder start; hive-0002's real births count."""
    cloud = start(store=store)
    hive1, hive2 = start("hive-0001", "hive-0001"), start("hive-0002", "hive-0002")
    send(hive2, topics.state(SITE, "hive-0002"), state("hive-0002", "birth", 3), retain=True)
    wait_until(lambda: (node(store, "hive-0002") or {}).get("online") is True, what="hive-0002's birth")

    spoof = state("hive-0002", "death", 10**12)
    send(hive1, topics.state(SITE, "hive-0001"), spoof, retain=True)  # the ACL lets it through: its own topic
    send(hive1, topics.event(SITE, "hive-0001"), event("hive-0001", 1))  # after the spoof, on one connection
    wait_until(recorded_event(store, "hive-0001", 1), what="hive-0001's event")
    hive2_now = node(store, "hive-0002")
    assert hive2_now["online"] and hive2_now["session"] == 3, hive2_now
    assert node(store, "hive-0001") is None  # nor does the spoof count as hive-0001's state
    assert cloud.count("device_state_refused") == 1

    send(hive2, topics.state(SITE, "hive-0002"), state("hive-0002", "birth", 4), retain=True)
    wait_until(lambda: (node(store, "hive-0002") or {}).get("session") == 4, what="hive-0002's next birth")

    cloud.transport.stop()  # a recorder start gets every retained state again, the spoof included
    again = start(store=store, client_id="cloud-recorder-2")
    wait_until(lambda: again.count("device_state_refused") == 1, what="the retained spoof, refused again")
    wait_until(lambda: again.count("device_state") == 1, what="hive-0002's retained birth")
    hive2_now = node(store, "hive-0002")
    assert hive2_now["online"] and hive2_now["session"] == 4 and hive2_now["status"] == "birth"


def test_a_huge_session_cannot_freeze_a_node_through_its_birth_and_last_will(acl_mosquitto, store, start) -> None:
    cloud = start(store=store)
    hive1 = start("hive-0001", "hive-0001-tool")
    send(hive1, topics.state(SITE, "hive-0001"), state("hive-0001", "birth", 1), retain=True)
    send(hive1, topics.state(SITE, "hive-0001"), state("hive-0001", "update", 999_999), retain=True)
    wait_until(lambda: cloud.count("device_state_ignored") == 1, what="the update, not of the current session")
    assert node(store, "hive-0001")["session"] == 1

    with device_with_will(acl_mosquitto.login("hive-0001"), SITE, "hive-0001", session=2) as device:
        wait_until(lambda: node(store, "hive-0001")["session"] == 2, what="the real birth, session 2")
        assert node(store, "hive-0001")["online"]
        device.kill()  # power cut: the broker publishes the Last Will (death, session 2)
        device.wait(10)
        wait_until(lambda: not node(store, "hive-0001")["online"], what="the Last Will")
    final = node(store, "hive-0001")
    assert final["status"] == "death" and final["session"] == 2


def test_answers_events_and_ota_status_are_stored_only_for_the_topics_node(acl_mosquitto, store, start) -> None:
    cloud = start(store=store)
    hive1 = start("hive-0001", "hive-0001")
    own = topics.answer(SITE, "hive-0001")
    send(hive1, own, InferenceResult(request_id="r-1", site=SITE, device="hive-0002", tier="cloud", text="forged"))
    send(hive1, topics.event(SITE, "hive-0001"), event("hive-0002", 7))
    send(hive1, topics.ota_status(SITE, "hive-0001"),
         OtaStatus(site=SITE, device="hive-0002", image_version="6.6.6", phase="committed"))
    send(hive1, topics.state(SITE, "hive-0001"), state("hive-0001", "birth", 1, site="s2"))  # another site
    # its own name, but on a topic kind that carries another type: an event on its state topic, a state on its
    # answer topic (the recorder used to store any type on any topic)
    send(hive1, topics.state(SITE, "hive-0001"), event("hive-0001", 8))
    send(hive1, own, state("hive-0001", "death", 1))
    send(hive1, own, InferenceResult(request_id="r-2", site=SITE, device="hive-0001", tier="edge", text="mine"))
    wait_until(lambda: store.answers(SITE, "hive-0001"), what="hive-0001's own answer")
    refused = lambda: [cloud.count(f"{kind}_refused") for kind in ("inference_result", "sensor_event",  # noqa: E731
                                                                     "ota_status", "device_state")]
    wait_until(lambda: refused() == [1, 2, 1, 2], what=f"every forgery refused (so far {refused()})")
    assert [a["request_id"] for a in store.answers(SITE, "hive-0001")] == ["r-2"]
    assert store.answers(SITE, "hive-0002") == [] and store.events(SITE, "hive-0002") == []
    assert store.events(SITE, "hive-0001") == []
    assert store.ota_statuses(SITE, "hive-0002") == [] and store.devices() == []


def test_values_the_store_cannot_hold_are_refused_at_decode_and_recording_goes_on(acl_mosquitto, store,
                                                                                   start) -> None:
    cloud = start(store=store)
    hive1 = start("hive-0001", "hive-0001")
    login = acl_mosquitto.login("hive-0001")
    ev_topic, state_topic = topics.event(SITE, "hive-0001"), topics.state(SITE, "hive-0001")
    for topic, payload in [
        (ev_topic, forged_payload(event("hive-0001", 1), seq=2**64 - 1)),
        (ev_topic, forged_payload(event("hive-0001", 2), timestamp=float("nan"))),
        (ev_topic, forged_payload(event("hive-0001", 3), readings={"hive_temp_c": float("inf")})),
        (state_topic, forged_payload(state("hive-0001", "birth", 1), session=2**64 - 1)),
    ]:
        publish_raw(login, topic, payload)
    send(hive1, ev_topic, event("hive-0001", 4))
    wait_until(recorded_event(store, "hive-0001", 4), what="the valid event after the bad ones")
    assert [e["seq"] for e in store.events(SITE, "hive-0001")] == [4]
    assert cloud.transport.stats["decode_errors"] == 4 and cloud.transport.stats["handler_errors"] == 0
    assert cloud.count("sensor_event_ignored") == 0 and store.devices() == []
