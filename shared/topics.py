"""The MQTT topic scheme: every topic the mesh uses is built and parsed here.

Namespace ``apiary/v1/{site}/{node}/…`` (Sparkplug-like: group = site, edge node =
device, bridge or cloud worker). ``v1`` is the topic-scheme version and moves with
``protocol.SCHEMA_VERSION`` only on breaking changes.

    event        bridge  -> edge     sensor events for one device             QoS 1
    answer       edge    -> cloud    final answer for an event (edge or cloud tier)
    escalate     edge    -> cloud    inference requests; workers use $share/{group}/…
    reply        cloud   -> edge     replies to escalations (only ever the escalating node's: reply_for)
    state        any     -> all      retained birth/death (Last Will) + telemetry
    ota/cmd      cloud   -> edge     OTA command
    ota/status   edge    -> cloud    OTA progress

Site and node names are restricted to ``[A-Za-z0-9_.-]`` so they can never contain
the MQTT wildcards ``+``/``#`` or a level separator.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

ROOT = "apiary/v1"
CLOUD_SITE = "_cloud"  # cloud workers publish their own state under this pseudo-site
DEFAULT_SITE = "site-0"  # the site of a bridge, simulator or edge agent not told one: they meet there
DEFAULT_SHARE_GROUP = "cloud-workers"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

KINDS = ("event", "answer", "escalate", "reply", "state", "ota/cmd", "ota/status")


class TopicError(ValueError):
    """A name or topic that does not fit the scheme."""


def _check(name: str, what: str) -> str:
    if not _NAME.match(name):
        raise TopicError(f"invalid {what} {name!r}: use 1-64 of [A-Za-z0-9_.-]")
    return name


def _topic(site: str, node: str, kind: str) -> str:
    return f"{ROOT}/{_check(site, 'site')}/{_check(node, 'node')}/{kind}"


def event(site: str, device: str) -> str:
    return _topic(site, device, "event")


def answer(site: str, device: str) -> str:
    return _topic(site, device, "answer")


def escalate(site: str, device: str) -> str:
    return _topic(site, device, "escalate")


def reply(site: str, device: str) -> str:
    return _topic(site, device, "reply")


def reply_for(escalation: str) -> str:
    """The one topic an escalation is answered on: the reply topic of the node it was published by.

    The broker's ACL lets a node publish only under its own topics, so this is a topic the sender
    may be answered on; a ``reply_to`` naming any other would make the cloud publish for it.
    """
    where = parse(escalation)
    if where.kind != "escalate":
        raise TopicError(f"not an escalation topic: {escalation!r}")
    return reply(where.site, where.node)


def state(site: str, node: str) -> str:
    return _topic(site, node, "state")


def ota_command(site: str, device: str) -> str:
    return _topic(site, device, "ota/cmd")


def ota_status(site: str, device: str) -> str:
    return _topic(site, device, "ota/status")


def all_of(kind: str, site: str = "+") -> str:
    """Filter for one kind across a site (or all sites), e.g. ``apiary/v1/+/+/answer``."""
    if kind not in KINDS:
        raise TopicError(f"unknown topic kind {kind!r}")
    return f"{ROOT}/{site}/+/{kind}"


def shared(filter_: str, group: str = DEFAULT_SHARE_GROUP) -> str:
    """A shared-subscription filter: the broker hands each message to one member of ``group``."""
    return f"$share/{_check(group, 'share group')}/{filter_}"


def escalations_shared(group: str = DEFAULT_SHARE_GROUP) -> str:
    return shared(all_of("escalate"), group)


@dataclass(frozen=True, slots=True)
class Topic:
    site: str
    node: str
    kind: str


def parse(topic: str) -> Topic:
    """Split a concrete topic into site, node and kind; :class:`TopicError` if it is not ours."""
    parts = topic.split("/")
    if len(parts) < 5 or "/".join(parts[:2]) != ROOT:
        raise TopicError(f"not an apiary topic: {topic!r}")
    site, node, kind = parts[2], parts[3], "/".join(parts[4:])
    if kind not in KINDS:
        raise TopicError(f"unknown topic kind {kind!r} in {topic!r}")
    return Topic(_check(site, "site"), _check(node, "node"), kind)
