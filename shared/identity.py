"""Who a message speaks for: the node of the topic it arrived on, never the names in its body.

The broker binds a client to topics (the shipped ACL lets a device publish only under
``apiary/v1/+/<its id>/#``), not to what it writes in a body. So every consumer takes the
sender's site and node from the topic and refuses a body whose ``site``/``device`` name anyone
else: otherwise hive-0001 could declare hive-0002 dead, or answer for it, from its own topics.
"""
from __future__ import annotations

from shared import topics
from shared.protocol import Envelope


class IdentityError(ValueError):
    """The body names another node than the topic it arrived on (or the topic is not ours)."""


def check(topic: str, env: Envelope) -> topics.Topic:
    """The topic's site and node when the body names exactly them; :class:`IdentityError` otherwise."""
    try:
        where = topics.parse(topic)
    except topics.TopicError as e:
        raise IdentityError(str(e)) from None
    named = (env.body.site, env.body.device)
    if named != (where.site, where.node):
        raise IdentityError(f"{env.type.value} {env.id} on {topic} names {named[0]}/{named[1]}, "
                            f"not the topic's {where.site}/{where.node}")
    return where
