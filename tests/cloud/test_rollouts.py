"""Rollout waves, outcomes and the abort rule without MQTT: the pure decision, then the driver on a real SQLite store
with the devices' OTA statuses recorded as the recorder records them and a clock the test moves."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from apiary.cloud import rollouts
from apiary.cloud.errors import CloudError
from apiary.cloud.store import open_store
from apiary.shared import image
from apiary.shared.protocol import DeviceState, OtaCommand, OtaStatus

VERSION = "2027.1.0"


@pytest.mark.parametrize("n, canary, wave_size, sizes", [
    (3, 0.3, None, [1, 2]), (3, 1 / 3, None, [1, 2]), (3, 0.34, None, [2, 1]), (10, 0.1, None, [1, 9]),
    (10, 0.25, 3, [3, 3, 3, 1]), (1, 0.1, None, [1]), (4, 1.0, None, [4]), (5, 0.01, 2, [1, 2, 2]), (0, 0.5, None, []),
])
def test_wave_sizes_put_a_rounded_up_canary_first_then_the_rest(n, canary, wave_size, sizes) -> None:
    assert rollouts.wave_sizes(n, canary, wave_size) == sizes


def test_assign_waves_keeps_the_given_order_and_a_canary_outside_zero_to_one_is_refused() -> None:
    nodes = [("b", "x"), ("a", "y"), ("a", "z")]
    assert rollouts.assign_waves(nodes, 0.3) == [("b", "x", 0), ("a", "y", 1), ("a", "z", 1)]
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError):
            rollouts.wave_sizes(3, bad)


def rollout_row(**over) -> dict:
    return {"wave": 0, "waves": 2, "wave_started_at": 100.0, "wave_timeout_s": 60.0, "max_failed_pct": 0.0,
            "image_version": VERSION, **over}


def dev(name: str, wave: int, *, sent: bool = True, phase: str | None = None, outcome: str | None = None) -> dict:
    return {"site": "s", "device": name, "wave": wave, "sent_at": 100.0 if sent else None, "ota_phase": phase,
            "outcome": outcome}


def test_decide_starts_the_canary_wave_then_waits_then_advances_when_every_canary_committed() -> None:
    fresh = [dev("a", 0, sent=False), dev("b", 1, sent=False), dev("c", 1, sent=False)]
    d = rollouts.decide(rollout_row(wave_started_at=None), fresh, now=100)
    assert (d.state, d.wave, d.wave_started, d.send) == ("running", 0, True, [("s", "a")])

    waiting = [dev("a", 0, phase="downloading"), dev("b", 1, sent=False), dev("c", 1, sent=False)]
    d = rollouts.decide(rollout_row(), waiting, now=130)
    assert (d.state, d.wave, d.wave_started, d.send, d.outcomes) == ("running", 0, False, [], {})

    deferred = [dev("a", 0, phase="deferred"), *waiting[1:]]  # a low battery is not an outcome
    assert rollouts.decide(rollout_row(), deferred, now=130).outcomes == {}

    done = [dev("a", 0, phase="committed"), *waiting[1:]]
    d = rollouts.decide(rollout_row(), done, now=130)
    assert d.outcomes == {("s", "a"): "committed"}
    assert (d.state, d.wave, d.wave_started, d.send) == ("running", 1, True, [("s", "b"), ("s", "c")])


def test_decide_completes_after_the_last_wave_and_counts_what_committed() -> None:
    devices = [dev("a", 0, outcome="committed"), dev("b", 1, phase="committed"), dev("c", 1, phase="rolled_back")]
    d = rollouts.decide(rollout_row(wave=1, max_failed_pct=50), devices, now=130)
    assert d.state == "completed" and d.reason == f"2 of 3 devices committed {VERSION}"
    assert d.outcomes == {("s", "b"): "committed", ("s", "c"): "failed"}


@pytest.mark.parametrize("phase", ["rolled_back", "refused", "failed"])
def test_one_failed_canary_aborts_at_once_and_skips_the_later_waves(phase: str) -> None:
    devices = [dev("a", 0, phase=phase), dev("b", 0, phase="downloading"), dev("c", 1, sent=False)]
    d = rollouts.decide(rollout_row(), devices, now=101)
    assert d.state == "aborted" and d.send == [] and d.skip == [("s", "c")]
    assert "wave 1 of 2: 1 of 2 devices" in d.reason and "more than the 0% allowed" in d.reason


def test_the_abort_rule_allows_up_to_its_percentage_of_a_wave() -> None:
    half = [dev("a", 0, phase="rolled_back"), dev("b", 0, phase="committed"), dev("c", 1, sent=False)]
    assert rollouts.decide(rollout_row(max_failed_pct=50), half, now=101).state == "running"  # 50 % is not more
    assert rollouts.decide(rollout_row(max_failed_pct=49.9), half, now=101).state == "aborted"
    d = rollouts.decide(rollout_row(max_failed_pct=50), half, now=101)
    assert (d.wave, d.send) == (1, [("s", "c")])


def test_a_wave_timeout_fails_the_devices_without_a_final_phase() -> None:
    devices = [dev("a", 0, phase="committed", outcome="committed"), dev("b", 0, phase="downloading"),
               dev("c", 0, sent=False), dev("d", 1, sent=False)]
    assert rollouts.decide(rollout_row(), devices, now=159.9).state == "running"
    d = rollouts.decide(rollout_row(max_failed_pct=70), devices, now=160)
    assert d.outcomes == {("s", "b"): "timed_out", ("s", "c"): "timed_out"}
    assert (d.state, d.wave, d.send) == ("running", 1, [("s", "d")])  # 2 of 3 failed: within 70 %
    d = rollouts.decide(rollout_row(max_failed_pct=50), devices, now=160)
    assert d.state == "aborted" and d.skip == [("s", "d")]


def test_an_outcome_once_recorded_stands_whatever_the_device_reports_later() -> None:
    late = [dev("a", 0, phase="committed", outcome="timed_out"), dev("b", 1, sent=False)]
    assert rollouts.decide(rollout_row(), late, now=300).state == "aborted"


# ---------------------------------------------------------------- the driver on a real store


class Fleet:
    """The store a cloud process would have, a clock, and the commands the driver published."""

    def __init__(self, store_url: str, nodes: list[tuple[str, str]]) -> None:
        self.store = open_store(store_url)
        self.now = 1000.0
        self.sent: list[OtaCommand] = []
        self.link_up = True
        self.ids = itertools.count()
        for site, device in nodes:
            self.store.record_state(DeviceState(site=site, device=device, status="birth", online=True, session=1),
                                    received_at=self.now)
        self.store.record_state(DeviceState(site="cloud", device="cloud-1", status="birth", online=True, session=1,
                                            role="cloud"), received_at=self.now)

    def clock(self) -> float:
        return self.now

    def publish(self, cmd: OtaCommand) -> bool:
        if self.link_up:
            self.sent.append(cmd)
        return self.link_up

    def driver(self, owner: str = "cloud-1") -> rollouts.RolloutDriver:
        return rollouts.RolloutDriver(self.store, self.publish, owner=owner, clock=self.clock)

    def report(self, device: str, phase: str, version: str = VERSION, site: str = "s") -> None:
        self.now += 1
        self.store.record_ota_status(f"env-{next(self.ids)}", OtaStatus(site=site, device=device,
                                                                        image_version=version, phase=phase),
                                     received_at=self.now)

    def create(self, targets: list[tuple[str, str]], **over) -> str:
        facts = rollouts.ImageFacts(filename="edge.tar", image_version=VERSION, sha256="0" * 64,
                                    signature="1" * 128, size=10)
        options = dict(canary=0.3, wave_size=None, max_failed_pct=0.0, wave_timeout_s=60.0, target={"site": "s"})
        return rollouts.create(self.store, facts, "http://cloud/v1/images/edge.tar", targets,
                               **{**options, **over}, now=self.now)

    def phases(self, rollout_id: str) -> dict[str, str]:
        return {d["device"]: d["phase"] for d in rollouts.view(self.store, rollout_id)["devices"]}


NODES = [("s", "a"), ("s", "b"), ("s", "c")]


@pytest.fixture
def fleet(store_url: str):
    """On SQLite and on PostgreSQL (tests/cloud/conftest.py)."""
    f = Fleet(store_url, NODES)
    yield f
    f.store.close()


def test_the_driver_takes_a_rollout_through_its_waves_from_the_statuses_in_the_store(fleet: Fleet) -> None:
    targets = rollouts.resolve_targets(fleet.store, site="s")
    assert targets == NODES  # the cloud's own node is no target
    rid = fleet.create(targets)
    driver = fleet.driver()
    assert fleet.phases(rid) == {"a": "pending", "b": "pending", "c": "pending"}
    driver.step()
    assert [(c.device, c.image_version, c.url) for c in fleet.sent] == [("a", VERSION, "http://cloud/v1/images/edge.tar")]
    assert fleet.phases(rid) == {"a": "sent", "b": "pending", "c": "pending"}
    fleet.report("a", "committed", version="2026.1.0")  # another image's status does not count
    fleet.report("a", "downloading")
    driver.step()
    assert len(fleet.sent) == 1 and fleet.phases(rid)["a"] == "downloading"
    fleet.report("a", "committed")
    driver.step()
    assert [c.device for c in fleet.sent] == ["a", "b", "c"]
    view = rollouts.view(fleet.store, rid)
    assert (view["state"], view["wave"], view["counts"]) == ("running", 1, {"committed": 1, "sent": 2})
    fleet.report("b", "committed")
    fleet.report("c", "received")
    driver.step()
    assert rollouts.view(fleet.store, rid)["state"] == "running"
    fleet.report("c", "committed")
    driver.step()
    view = rollouts.view(fleet.store, rid)
    assert view["state"] == "completed" and view["reason"] == f"3 of 3 devices committed {VERSION}"
    assert [d["outcome"] for d in view["devices"]] == ["committed"] * 3 and len(fleet.sent) == 3
    assert fleet.store.busy_devices(NODES) == {}  # a finished rollout holds no device


def test_a_canary_that_rolls_back_aborts_and_the_rest_never_get_a_command(fleet: Fleet) -> None:
    rid = fleet.create(NODES)
    driver = fleet.driver()
    driver.step()
    fleet.report("a", "health_check")
    fleet.report("a", "rolled_back")
    driver.step()
    view = rollouts.view(fleet.store, rid)
    assert view["state"] == "aborted" and "1 of 1 devices rolled back" in view["reason"]
    assert fleet.phases(rid) == {"a": "rolled_back", "b": "skipped", "c": "skipped"}
    driver.step()
    assert [c.device for c in fleet.sent] == ["a"]


def test_an_unacknowledged_command_is_sent_again_and_the_wave_times_out_on_silence(fleet: Fleet) -> None:
    rid = fleet.create(NODES, canary=1.0, max_failed_pct=40)
    driver = fleet.driver()
    fleet.link_up = False
    driver.step()
    assert fleet.sent == [] and fleet.phases(rid) == {"a": "pending", "b": "pending", "c": "pending"}
    fleet.link_up = True
    fleet.now += 5
    driver.step()
    assert sorted(c.device for c in fleet.sent) == ["a", "b", "c"]
    fleet.report("a", "committed")
    fleet.report("b", "committed")
    fleet.now += 60  # c never answers: one of three timed out, within 40 %
    driver.step()
    view = rollouts.view(fleet.store, rid)
    assert view["state"] == "completed" and view["reason"] == f"2 of 3 devices committed {VERSION}"
    assert {d["device"]: d["outcome"] for d in view["devices"]} == {"a": "committed", "b": "committed",
                                                                     "c": "timed_out"}


def test_a_second_driver_waits_for_the_first_ones_lease_and_a_restarted_one_resumes_at_once(fleet: Fleet) -> None:
    rid = fleet.create(NODES)
    first = fleet.driver("cloud-1")
    first.step()
    other = fleet.driver("cloud-2")
    fleet.report("a", "committed")
    other.step()
    assert len(fleet.sent) == 1  # cloud-1 holds it
    again = fleet.driver("cloud-1")  # cloud-1 restarted: its own lease
    again.step()
    assert [c.device for c in fleet.sent] == ["a", "b", "c"]
    again.stop()  # a clean stop ends the lease: cloud-2 takes over at once
    fleet.report("b", "committed")
    fleet.report("c", "committed")
    other.step()
    assert rollouts.view(fleet.store, rid)["state"] == "completed"


def test_targets_and_conflicts(fleet: Fleet) -> None:
    fleet.store.record_state(DeviceState(site="t", device="z", status="birth", online=True, session=1),
                             received_at=fleet.now)
    assert rollouts.resolve_targets(fleet.store, everything=True) == [*NODES, ("t", "z")]
    assert rollouts.resolve_targets(fleet.store, devices=[("t", "z"), ("s", "b"), ("t", "z")]) == [("t", "z"),
                                                                                                    ("s", "b")]
    with pytest.raises(CloudError, match="not known edge devices: s/nope, cloud/cloud-1"):
        rollouts.resolve_targets(fleet.store, devices=[("s", "nope"), ("cloud", "cloud-1")])
    with pytest.raises(rollouts.NoTargets, match="no known edge devices at site 'empty'"):
        rollouts.resolve_targets(fleet.store, site="empty")
    with pytest.raises(CloudError, match="exactly one target"):
        rollouts.resolve_targets(fleet.store, site="s", everything=True)
    rid = fleet.create([("s", "b")], canary=1.0)
    with pytest.raises(rollouts.RolloutConflict, match=f"s/b \\({rid}\\)"):
        fleet.create(NODES)


def test_image_facts_are_read_from_the_archive_and_a_non_image_is_refused(tmp_path: Path) -> None:
    private, _ = image.write_keypair(tmp_path / "keys", "k")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(1000))
    info = image.build_image(tmp_path / "img.tar", model, VERSION, private)
    facts = rollouts.image_facts(info.path)
    assert facts == rollouts.ImageFacts("img.tar", VERSION, info.sha256, info.signature, info.size)
    bogus = tmp_path / "bogus.tar"
    bogus.write_bytes(b"not a tar" * 100)
    with pytest.raises(CloudError, match="not a readable image archive"):
        rollouts.image_facts(bogus)


def test_the_recorder_wakes_the_driver_once_per_stored_ota_status(fleet: Fleet) -> None:
    from apiary.cloud.recorder import Recorder
    from apiary.shared import topics
    from apiary.shared.protocol import make

    seen: list[str] = []
    recorder = Recorder(fleet.store, on_ota_status=lambda status: seen.append(status.phase))
    env = make(OtaStatus(site="s", device="a", image_version=VERSION, phase="received"), sender="a")
    recorder.handle(topics.ota_status("s", "a"), env)
    recorder.handle(topics.ota_status("s", "a"), env)  # a QoS 1 redelivery: stored once, no second wake-up
    recorder.handle(topics.ota_status("s", "b"), make(OtaStatus(site="s", device="a", image_version=VERSION,
                                                                phase="committed"), sender="b"))  # a spoof: refused
    assert seen == ["received"]


def test_the_cli_refuses_a_device_without_its_site_before_calling_the_cloud() -> None:
    from typer.testing import CliRunner

    from apiary.cli import app

    result = CliRunner().invoke(app, ["image", "rollout", "edge.tar", "--url", "http://127.0.0.1:9", "--api-key", "k",
                                      "--device", "hive-1"])
    assert result.exit_code == 2 and "--device takes SITE/DEVICE" in result.output, result.output


# ---------------------------------------------------------------- the REST routes, without a broker


@pytest.fixture
def api(fleet: Fleet, tmp_path: Path):
    """The real app on the fleet's store, with no broker and no engine (these routes use neither)."""
    from starlette.testclient import TestClient

    from apiary.cloud.api import AppContext, create_app
    from apiary.cloud.auth import KeyRing
    from apiary.cloud.metrics import Metrics
    from apiary.cloud.settings import CloudSettings

    keys = KeyRing(tmp_path / "keys.jsonl")
    settings = CloudSettings(images=str(tmp_path / "images"), db=str(tmp_path / "cloud.db"),
                             api_key_file=str(keys.path))
    (tmp_path / "images").mkdir()
    app = create_app(AppContext(settings=settings, engine=None, store=fleet.store, keys=keys, metrics=Metrics(),
                                model_name="m"))
    with TestClient(app, headers={"Authorization": f"Bearer {keys.create(['operator'])}"}) as client:
        client.inference_key = keys.create(["inference"])
        yield client


def test_the_routes_show_rollouts_and_refuse_what_they_cannot_run(api, fleet: Fleet, tmp_path: Path) -> None:
    rid = fleet.create(NODES)
    fleet.driver().step()
    fleet.report("a", "downloading")
    one = api.get(f"/v1/fleet/rollouts/{rid}")
    assert one.status_code == 200, one.text
    body = one.json()
    assert (body["state"], body["image_version"], body["waves"], body["wave"]) == ("running", VERSION, 2, 0)
    assert [(d["device"], d["wave"], d["phase"]) for d in body["devices"]] == [("a", 0, "downloading"),
                                                                             ("b", 1, "pending"), ("c", 1, "pending")]
    assert body["counts"] == {"downloading": 1, "pending": 2} and "signature" not in body
    listed = api.get("/v1/fleet/rollouts", params={"state": "running"}).json()
    assert [r["id"] for r in listed] == [rid] and "devices" not in listed[0]
    assert api.get("/v1/fleet/rollouts", params={"state": "aborted"}).json() == []
    assert api.get("/v1/fleet/rollouts/ro-nope").status_code == 404
    assert api.get("/v1/fleet/rollouts", headers={"Authorization": f"Bearer {api.inference_key}"}).status_code == 403

    ok = {"filename": "edge.tar", "site": "s"}
    for bad in ({"filename": "edge.tar"}, {**ok, "all": True}, {**ok, "canary": 0}, {**ok, "max_failed_pct": 101},
                {"filename": "edge.tar", "devices": []}, {"filename": "../x", "all": True}):
        r = api.post("/v1/fleet/rollouts", json=bad)
        assert r.status_code == 422, (bad, r.text)
    assert "exactly one target" in api.post("/v1/fleet/rollouts", json={"filename": "edge.tar"}).text
    assert api.post("/v1/fleet/rollouts", json=ok).status_code == 404  # no such image
    (tmp_path / "images" / "edge.tar").write_bytes(b"x" * 10)
    r = api.post("/v1/fleet/rollouts", json=ok)
    assert r.status_code == 503 and "MQTT broker" in r.json()["error"]["message"]


# ---------------------------------------------------------------- signed rollbacks


@pytest.fixture
def live_api(fleet: Fleet, tmp_path: Path, mosquitto):
    """The real app on the fleet's store with a real broker connection (Mosquitto) and the fleet's driver."""
    from starlette.testclient import TestClient

    from apiary.cloud.api import AppContext, create_app
    from apiary.cloud.auth import KeyRing
    from apiary.cloud.metrics import Metrics
    from apiary.cloud.settings import CloudSettings
    from apiary.shared.transport import MqttTransport

    keys = KeyRing(tmp_path / "keys.jsonl")
    settings = CloudSettings(images=str(tmp_path / "images"), db=str(tmp_path / "cloud.db"),
                             api_key_file=str(keys.path))
    (tmp_path / "images").mkdir()
    with MqttTransport(mosquitto.config, "cloud-1", persistent=False) as transport:
        app = create_app(AppContext(settings=settings, engine=None, store=fleet.store, keys=keys, metrics=Metrics(),
                                    model_name="m", transport=transport, rollouts=fleet.driver()))
        with TestClient(app, headers={"Authorization": f"Bearer {keys.create(['operator'])}"}) as client:
            yield client


def older_image(tmp_path: Path) -> tuple[image.ImageInfo, tuple[Path, Path]]:
    """A signed 2026.1.0 image in the app's images directory and an operator key pair."""
    model = tmp_path / "src" / "model.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF" + bytes(1000))
    image_key, _ = image.write_keypair(tmp_path / "keys", "image")
    info = image.build_image(tmp_path / "images" / "edge-2026.1.0.tar", model, "2026.1.0", image_key)
    return info, image.write_keypair(tmp_path / "keys", "operator")


def grant_for(info: image.ImageInfo, site: str, device: str, key: Path) -> dict:
    cmd = OtaCommand(site=site, device=device, image_version=info.manifest.image_version, url="-", sha256=info.sha256,
                     signature=info.signature, size=info.size)
    return {"site": site, "device": device, **image.sign_rollback(cmd, key, ttl_s=3600).rollback.model_dump()}


def test_a_rollback_rollout_gives_each_device_its_own_grant_and_needs_one_for_every_target(
        live_api, fleet: Fleet, tmp_path: Path) -> None:
    info, (operator, operator_pub) = older_image(tmp_path)
    grants = [grant_for(info, s, d, operator) for s, d in NODES]
    body = {"filename": info.path.name, "site": "s", "canary": 0.3}
    r = live_api.post("/v1/fleet/rollouts", json={**body, "rollback": grants[:2]})
    assert r.status_code == 422 and "needs a grant for every target device; none for s/c" in r.text, r.text
    assert fleet.sent == []

    r = live_api.post("/v1/fleet/rollouts", json={**body, "rollback": grants})
    assert r.status_code == 201, r.text
    [canary] = fleet.sent  # sent before the answer
    assert (canary.device, canary.image_version, canary.rollback.nonce) == ("a", "2026.1.0", grants[0]["nonce"])
    assert image.verify_rollback(canary, [operator_pub]) == operator_pub.read_text().strip()
    fleet.report("a", "committed", version="2026.1.0")
    fleet.driver().step()
    assert [c.device for c in fleet.sent] == ["a", "b", "c"]
    for cmd, grant in zip(fleet.sent, grants):
        assert cmd.rollback.model_dump() == {k: grant[k] for k in ("expires", "nonce", "signature")}
        image.verify_rollback(cmd, [operator_pub])  # each verifies for its own device only
    with pytest.raises(image.ImageError):
        image.verify_rollback(fleet.sent[1].model_copy(update={"rollback": fleet.sent[2].rollback}), [operator_pub])


def test_the_ota_route_sends_a_signed_rollback_to_one_device_over_the_broker(live_api, fleet: Fleet, tmp_path: Path,
                                                                             mosquitto) -> None:
    from apiary.shared import topics
    from apiary.shared.transport import MqttTransport
    from tests.shared.helpers import Inbox, wait_until

    info, (operator, operator_pub) = older_image(tmp_path)
    grant = grant_for(info, "s", "b", operator)
    body = {"site": "s", "image_version": "2026.1.0", "filename": info.path.name, "sha256": info.sha256,
            "signature": info.signature, "size": info.size, "rollback": {k: grant[k] for k in ("expires", "nonce",
                                                                                               "signature")}}
    r = live_api.post("/v1/fleet/ota", json=body)  # a whole site: a grant names one device
    assert r.status_code == 422 and "a rollback grant is signed for one device: give device" in r.text, r.text
    inbox = Inbox()
    with MqttTransport(mosquitto.config, "device-b", persistent=False) as device:
        device.subscribe(topics.ota_command("s", "b"), inbox)
        assert device.wait_subscribed(10)
        r = live_api.post("/v1/fleet/ota", json={**body, "device": "b"})
        assert r.status_code == 200 and r.json()["targets"][0]["acked"], r.text
        wait_until(lambda: inbox.envs, 10, "the rollback command on the device's ota/cmd topic")
    cmd = inbox.envs[0].body
    assert cmd.rollback.nonce == grant["nonce"] and cmd.url.endswith(f"/v1/images/{info.path.name}")
    image.verify_rollback(cmd, [operator_pub])


def test_the_rollout_cli_signs_a_grant_for_every_device_the_cloud_resolves(live_api, fleet: Fleet,
                                                                           tmp_path: Path) -> None:
    """`apiary image rollout --operator-key`'s request: the site's edge devices read from the fleet API, one grant
    each over the local archive's version and sha256; the cloud takes it and every command verifies."""
    from apiary.deploy.cli import _rollback_grants

    info, (operator, operator_pub) = older_image(tmp_path)
    body = {"filename": info.path.name, "site": "s", "canary": 1.0}
    body.update(_rollback_grants(live_api, info.path, body, operator, 3600))
    assert body["sha256"] == info.sha256 and [(g["site"], g["device"]) for g in body["rollback"]] == NODES
    r = live_api.post("/v1/fleet/rollouts", json=body)
    assert r.status_code == 201, r.text
    assert [c.device for c in fleet.sent] == ["a", "b", "c"]  # canary 1.0: one wave
    for cmd in fleet.sent:
        image.verify_rollback(cmd, [operator_pub])
