from __future__ import annotations

import pytest

from apiary.shared import topics


def test_builders_and_parse_round_trip() -> None:
    for build, kind in [(topics.event, "event"), (topics.answer, "answer"), (topics.escalate, "escalate"),
                        (topics.reply, "reply"), (topics.state, "state"), (topics.ota_command, "ota/cmd"),
                        (topics.ota_status, "ota/status")]:
        t = build("meadow", "hive-0001")
        assert t == f"apiary/v1/meadow/hive-0001/{kind}"
        assert topics.parse(t) == topics.Topic("meadow", "hive-0001", kind)


def test_shared_subscription_filter() -> None:
    assert topics.escalations_shared() == "$share/cloud-workers/apiary/v1/+/+/escalate"
    assert topics.all_of("answer", site="meadow") == "apiary/v1/meadow/+/answer"


@pytest.mark.parametrize("bad", ["", "a/b", "+", "#", "x" * 65, "hive 1"])
def test_names_that_would_break_the_scheme_are_refused(bad: str) -> None:
    with pytest.raises(topics.TopicError):
        topics.event("meadow", bad)


@pytest.mark.parametrize("bad", ["foo/bar", "apiary/v1/s/d", "apiary/v1/s/d/unknown", "apiary/v2/s/d/event"])
def test_parse_rejects_foreign_topics(bad: str) -> None:
    with pytest.raises(topics.TopicError):
        topics.parse(bad)


def test_an_escalation_is_answered_on_the_reply_topic_of_its_node() -> None:
    assert topics.reply_for(topics.escalate("meadow", "hive-0001")) == topics.reply("meadow", "hive-0001")


@pytest.mark.parametrize("bad", ["apiary/v1/meadow/hive-0001/event", "apiary/v1/+/hive-0001/escalate",
                                 "apiary/v1/meadow/#", "elsewhere/meadow/hive-0001/escalate"])
def test_only_a_concrete_escalation_topic_has_a_reply_topic(bad: str) -> None:
    with pytest.raises(topics.TopicError):
        topics.reply_for(bad)
