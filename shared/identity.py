"""Who a message speaks for: the node of the topic it arrived on, never the names in its body.

The broker binds a client to topics (the shipped ACL lets a device publish only under
``apiary/v1/+/<its id>/#``), not to what it writes in a body. So every consumer takes the
sender's site and node from the topic and refuses a body whose ``site``/``device`` name anyone
else: otherwise hive-0001 could declare hive-0002 dead, or answer for it, from its own topics.
Each topic kind also carries one message type only: an answer published on a state topic is
not a state, whatever it says.
"""
from __future__ import annotations

from apiary.shared import topics
from apiary.shared.protocol import Envelope, MessageType

TYPE_OF_KIND: dict[str, MessageType] = {
    "event": MessageType.SENSOR_EVENT,
    "answer": MessageType.INFERENCE_RESULT,
    "escalate": MessageType.INFERENCE_REQUEST,
    "reply": MessageType.INFERENCE_RESULT,
    "state": MessageType.DEVICE_STATE,
    "ota/cmd": MessageType.OTA_COMMAND,
    "ota/status": MessageType.OTA_STATUS,
}
assert set(TYPE_OF_KIND) == set(topics.KINDS)


class IdentityError(ValueError):
    """The body names another node than the topic it arrived on (or the topic is not ours)."""


def check(topic: str, env: Envelope) -> topics.Topic:
    """The topic's site and node when the body is the topic kind's message type and names exactly them;
    :class:`IdentityError` otherwise."""
    try:
        where = topics.parse(topic)
    except topics.TopicError as e:
        raise IdentityError(str(e)) from None
    if env.type != TYPE_OF_KIND[where.kind]:
        raise IdentityError(f"{env.type.value} {env.id} on {topic}: a {where.kind} topic carries "
                            f"{TYPE_OF_KIND[where.kind].value} only")
    named = (env.body.site, env.body.device)
    if named != (where.site, where.node):
        raise IdentityError(f"{env.type.value} {env.id} on {topic} names {named[0]}/{named[1]}, "
                            f"not the topic's {where.site}/{where.node}")
    return where
