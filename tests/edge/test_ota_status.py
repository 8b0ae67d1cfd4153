"""An update that ends while the device's link is down still reports its end: the final status the link did not
take is kept and sent when the link is back (a rollout waits for it; `apiary bench mesh` lost two this way when its
broker restart fell on the end of two health checks, and their wave could only time out)."""
from __future__ import annotations

from pathlib import Path

import pytest

from apiary.shared import image, topics
from apiary.shared.protocol import OtaStatus
from tests.edge.helpers import FileServer
from tests.edge.test_ota import DEVICE, SITE, command, ok_check, small_image, updater


class Link:
    """A publisher with a link that can be down: then publish takes nothing (as MqttTransport.publish says)."""

    def __init__(self) -> None:
        self.up = True
        self.sent: list[OtaStatus] = []

    def publish(self, topic: str, env, *, qos: int = 1, retain: bool = False, timeout: float | None = None) -> bool:
        assert topic == topics.ota_status(SITE, DEVICE)
        if self.up:
            self.sent.append(env.body)
        return self.up


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return image.write_keypair(tmp_path_factory.mktemp("keys"), "ota")


def test_a_final_status_the_link_did_not_take_is_sent_when_it_is_back(tmp_path: Path, server: FileServer,
                                                                      keys: tuple[Path, Path]) -> None:
    v1 = small_image(tmp_path, keys[0], "1.0.0")
    server.files["v1.tar"] = v1.path
    link = Link()

    def check_then_lose_the_link(model: Path, manifest: image.Manifest) -> str:
        link.up = False  # the broker restarts during the health check
        return ok_check(model, manifest)

    ota = updater(tmp_path / "state", keys[1], link, health_check=check_then_lose_the_link)
    assert ota.handle(command(v1, server.url("v1.tar"))).phase == "committed"
    assert link.sent[-1].phase == "health_check"  # committed never left
    ota.announce_boot()  # a reconnect that failed at once: still kept
    link.up = True
    ota.announce_boot()  # the next birth
    assert [s.phase for s in link.sent[-2:]] == ["health_check", "committed"]
    ota.announce_boot()  # sent once only
    assert [s.phase for s in link.sent].count("committed") == 1


def test_unsent_final_statuses_are_kept_per_image_version_and_progress_is_never_kept(tmp_path: Path, server: FileServer,
                                                                                keys: tuple[Path, Path]) -> None:
    v1, v2 = small_image(tmp_path, keys[0], "1.0.0"), small_image(tmp_path, keys[0], "2.0.0")
    server.files.update({"v1.tar": v1.path, "v2.tar": v2.path})
    link = Link()
    link.up = False
    ota = updater(tmp_path / "state", keys[1], link, health_check=ok_check)
    assert ota.handle(command(v1, server.url("v1.tar"))).phase == "committed"
    link.up = True
    assert ota.handle(command(v1, server.url("v1.tar"), image_version="0.9.0")).phase == "refused"  # downgrade
    ota.announce_boot()
    assert [(s.image_version, s.phase) for s in link.sent] == [("0.9.0", "received"), ("0.9.0", "refused"),
                                                                ("1.0.0", "committed")]  # v1's, kept meanwhile
    link.sent.clear()
    link.up = False
    assert ota.handle(command(v2, server.url("v2.tar"))).phase == "committed"
    assert ota.handle(command(v2, server.url("v2.tar"))).detail == "already running this image"  # its newest
    link.up = True
    ota.announce_boot()
    assert [(s.image_version, s.phase, s.detail) for s in link.sent] == [("2.0.0", "committed",
                                                                          "already running this image")]
