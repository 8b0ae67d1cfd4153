"""A message speaks for the node of the topic it arrived on: a body naming anyone else is refused."""
from __future__ import annotations

import pytest

from apiary.shared import identity, topics
from apiary.shared.protocol import DeviceState, InferenceResult, SensorEvent, make


def state(site: str = "s1", device: str = "hive-0001"):
    return make(DeviceState(site=site, device=device, status="birth", online=True, session=1), sender="t")


def test_a_body_naming_the_topics_node_speaks_for_it() -> None:
    assert identity.check(topics.state("s1", "hive-0001"), state()) == topics.Topic("s1", "hive-0001", "state")
    cloud = state(topics.CLOUD_SITE, "cloud-1")
    assert identity.check(topics.state(topics.CLOUD_SITE, "cloud-1"), cloud).site == topics.CLOUD_SITE


@pytest.mark.parametrize("topic, env, message", [
    (topics.state("s1", "hive-0001"), state(device="hive-0002"), "names s1/hive-0002"),
    (topics.state("s1", "hive-0001"), state(site="s2"), "names s2/hive-0001"),
    (topics.answer("s1", "hive-0001"), make(InferenceResult(request_id="r", site="s1", device="hive-0002",
                                                            tier="cloud"), sender="t"), "names s1/hive-0002"),
    (topics.event("s1", "hive-0001"), make(SensorEvent(site="s1", device="hive-0002", seq=1, timestamp=1.0,
                                                       readings={}), sender="t"), "on apiary/v1/s1/hive-0001/event"),
    ("not/an/apiary/topic/x", state(), "not an apiary topic"),
    (topics.state("s1", "hive-0001"), make(SensorEvent(site="s1", device="hive-0001", seq=1, timestamp=1.0,
                                                       readings={}), sender="t"), "carries device_state only"),
    (topics.event("s1", "hive-0001"), state(), "carries sensor_event only"),
])
def test_a_body_naming_another_node_is_refused(topic: str, env, message: str) -> None:
    with pytest.raises(identity.IdentityError, match=message):
        identity.check(topic, env)
