"""Fleet rollouts: one signed image taken to a set of devices in waves, a canary wave first.

A rollout is created by ``POST /v1/fleet/rollouts`` (:func:`create`) and lives in the store
(``rollouts``, ``rollout_devices``), so any cloud process can show it and a restarted one
resumes it. The devices are put in waves once, at creation: the canary wave (a fraction of
the targets, at least one device), then the rest (in waves of ``wave_size`` when given).
A device's phase is the newest OTA status of the rollout's image version that the recorder
stored after its command was sent; the driver never keeps a phase of its own.

:class:`RolloutDriver` (a thread in the cloud service) takes each running rollout a step:
it publishes the commands of the current wave that are not out yet (through
:func:`publish_command`, the path of ``POST /v1/fleet/ota``), decides each device's outcome
(``committed``; ``failed`` for rolled_back, refused or failed; ``timed_out`` when the wave's
timeout passed without a final phase), and then :func:`decide` says what follows:

* more than ``max_failed_pct`` % of the wave's devices failed or timed out: **aborted**, the
  devices of later waves are marked ``skipped`` and never get a command (those of the wave
  already running keep reporting);
* every device of the wave has an outcome: the next wave starts, or, after the last one,
  the rollout is **completed**.

The recorder wakes the driver on every stored OTA status; it also looks every ``poll_s``
(timeouts, statuses recorded by another replica). A rollback to an older image carries one operator-signed
grant per device (kept in the rollout's ``target`` under ``rollback``), which the driver puts on that device's
command. A process drives a rollout under a lease
in the store (``claim_rollout``) so two replicas never drive the same one; a restart under
the same worker id takes its own rollouts back at once.
"""
from __future__ import annotations

import math
import secrets
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from apiary.shared import image, topics
from apiary.shared.logs import get_logger
from apiary.shared.protocol import OtaCommand, RollbackGrant, make

from apiary.cloud.errors import CloudError
from apiary.cloud.store import Store

_log = get_logger("apiary.cloud.rollouts")

STATES = ("running", "completed", "aborted")
COMMITTED = "committed"
FAILED_PHASES = frozenset({"rolled_back", "refused", "failed"})
FAILED_OUTCOMES = frozenset({"failed", "timed_out"})


class NoTargets(CloudError):
    """The target names no known edge device."""


class RolloutConflict(CloudError):
    """A target device is already in a running rollout."""


def publish_command(transport: Any, cmd: OtaCommand, *, sender: str, timeout: float = 5.0) -> tuple[str, bool]:
    """Publish ``cmd`` on its device's ota/cmd topic (QoS 1); (the topic, whether the broker acknowledged it)."""
    topic = topics.ota_command(cmd.site, cmd.device)
    if transport is None or not transport.connected:
        return topic, False
    return topic, transport.publish(topic, make(cmd, sender=sender), qos=1, timeout=timeout)


# ---------------------------------------------------------------- the image


@dataclass(frozen=True, slots=True)
class ImageFacts:
    """What an OTA command must carry about an archive the cloud serves."""

    filename: str
    image_version: str
    sha256: str
    signature: str
    size: int


def image_facts(path: Path) -> ImageFacts:
    """Read an image's version and signature from its manifest (the signature is checked by the devices, which
    hold the trusted key; the cloud only reads what to announce), and hash the archive."""
    try:
        with tarfile.open(path, "r:") as tar:
            members = {m.name: m for m in tar.getmembers()}
            if image.MANIFEST_NAME not in members or image.SIGNATURE_NAME not in members:
                raise CloudError(f"{path.name} is not a signed edge image (no manifest.json / manifest.sig)")
            manifest = image.Manifest.from_bytes(_member(tar, members[image.MANIFEST_NAME]))
            signature = _member(tar, members[image.SIGNATURE_NAME]).decode("ascii", "replace").strip().lower()
    except (tarfile.TarError, OSError, EOFError) as e:
        raise CloudError(f"{path.name} is not a readable image archive: {e}") from None
    except image.ImageError as e:
        raise CloudError(f"{path.name}: {e}") from None
    if len(signature) != 128 or any(c not in "0123456789abcdef" for c in signature):
        raise CloudError(f"{path.name}: manifest.sig is not a 128-hex-digit signature")
    return ImageFacts(filename=path.name, image_version=manifest.image_version, sha256=image.sha256_file(path),
                      signature=signature, size=path.stat().st_size)


def _member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    f = tar.extractfile(member) if member.isfile() and member.size <= image.MAX_MANIFEST_BYTES else None
    if f is None:
        raise CloudError(f"{member.name} is not a small regular file")
    return f.read()


# ---------------------------------------------------------------- waves and decisions


def wave_sizes(n: int, canary: float, wave_size: int | None = None) -> list[int]:
    """How many devices each wave takes: ceil(canary * n) (at least 1) first, then the rest in waves of
    ``wave_size`` (all of them in one wave when None)."""
    if n <= 0:
        return []
    if not 0 < canary <= 1:
        raise ValueError(f"canary must be in (0, 1], got {canary}")
    first = min(n, max(1, math.ceil(canary * n - 1e-9)))
    sizes, left = [first], n - first
    step = wave_size or left
    while left > 0:
        sizes.append(min(step, left))
        left -= sizes[-1]
    return sizes


def assign_waves(devices: list[tuple[str, str]], canary: float, wave_size: int | None = None
                 ) -> list[tuple[str, str, int]]:
    """(site, device, wave) for ``devices`` in the given order: the first ones are the canaries."""
    out, at = [], 0
    for wave, size in enumerate(wave_sizes(len(devices), canary, wave_size)):
        out += [(site, device, wave) for site, device in devices[at:at + size]]
        at += size
    return out


def outcome_of(phase: str | None) -> str | None:
    """The outcome a final OTA phase gives a device; None while it is still on its way (or deferred)."""
    if phase == COMMITTED:
        return "committed"
    return "failed" if phase in FAILED_PHASES else None


@dataclass(slots=True)
class Decision:
    """What a step does to one rollout: device outcomes to record, commands to send, the rollout's next state."""

    outcomes: dict[tuple[str, str], str] = field(default_factory=dict)
    send: list[tuple[str, str]] = field(default_factory=list)
    skip: list[tuple[str, str]] = field(default_factory=list)
    state: str = "running"
    wave: int = 0
    wave_started: bool = False  # ``wave`` starts now
    reason: str = ""


def decide(rollout: dict[str, Any], devices: list[dict[str, Any]], now: float) -> Decision:
    """The next step of a running rollout, from its row and :meth:`Store.rollout_devices` (pure; no I/O)."""
    wave = rollout["wave"]
    d = Decision(state="running", wave=wave)
    current = [x for x in devices if x["wave"] == wave]
    outcome = {(x["site"], x["device"]): x["outcome"] for x in current}
    for x in current:
        key = (x["site"], x["device"])
        if outcome[key] is None and x["sent_at"] is not None:
            new = outcome_of(x["ota_phase"])
            if new is not None:
                outcome[key] = d.outcomes[key] = new
    started = rollout["wave_started_at"]
    if started is not None and now - started >= rollout["wave_timeout_s"]:
        for key, got in outcome.items():
            if got is None:
                outcome[key] = d.outcomes[key] = "timed_out"
    failed = sum(o in FAILED_OUTCOMES for o in outcome.values())
    if failed * 100 > rollout["max_failed_pct"] * len(current):
        d.state = "aborted"
        d.reason = (f"wave {wave + 1} of {rollout['waves']}: {failed} of {len(current)} devices rolled back, "
                    f"were refused, failed or timed out (more than the {rollout['max_failed_pct']:g}% allowed)")
        d.skip = [(x["site"], x["device"]) for x in devices if x["wave"] > wave]
        return d
    if all(o is not None for o in outcome.values()):
        if wave + 1 >= rollout["waves"]:
            d.state = "completed"
            committed = sum((x["outcome"] or d.outcomes.get((x["site"], x["device"]))) == "committed"
                            for x in devices)
            d.reason = f"{committed} of {len(devices)} devices committed {rollout['image_version']}"
            return d
        d.wave, d.wave_started = wave + 1, True
        current = [x for x in devices if x["wave"] == wave + 1]
    elif started is None:
        d.wave_started = True
    d.send = [(x["site"], x["device"]) for x in current if x["sent_at"] is None]
    return d


# ---------------------------------------------------------------- creating and showing


def resolve_targets(store: Store, *, site: str | None = None, devices: list[tuple[str, str]] | None = None,
                    everything: bool = False) -> list[tuple[str, str]]:
    """The devices a rollout goes to: a site's known edge devices, the listed ones (in their order; each must be
    a known edge device), or every known edge device; sorted by site and name unless listed."""
    if sum((site is not None, devices is not None, everything)) != 1:
        raise CloudError("give exactly one target: a site, a device list, or all")
    known = {(d["site"], d["device"]): d for d in store.devices(site) if d["role"] == "edge"}
    if devices is None:
        targets = sorted(known)
        if not targets:
            raise NoTargets(f"no known edge devices{f' at site {site!r}' if site else ''}")
        return targets
    if not devices:
        raise CloudError("the device list is empty")
    listed = list(dict.fromkeys(devices))
    unknown = [f"{s}/{n}" for s, n in listed if (s, n) not in known]
    if unknown:
        raise CloudError(f"not known edge devices: {', '.join(unknown)}")
    return listed


def create(store: Store, facts: ImageFacts, url: str, targets: list[tuple[str, str]], *, canary: float,
           wave_size: int | None, max_failed_pct: float, wave_timeout_s: float, target: dict[str, Any],
           created_by: str = "", now: float | None = None) -> str:
    """Store a new running rollout (its first wave is sent by the driver's next step); its id."""
    busy = store.busy_devices(targets)
    if busy:
        raise RolloutConflict("already in a running rollout: " + ", ".join(
            f"{s}/{n} ({rid})" for (s, n), rid in sorted(busy.items())))
    placed = assign_waves(targets, canary, wave_size)
    now = now or time.time()
    rollout_id = f"ro-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}-{secrets.token_hex(3)}"
    store.create_rollout({
        "id": rollout_id, "filename": facts.filename, "image_version": facts.image_version, "sha256": facts.sha256,
        "signature": facts.signature, "size": facts.size, "url": url, "target": target, "canary": canary,
        "wave_size": wave_size, "max_failed_pct": max_failed_pct, "wave_timeout_s": wave_timeout_s,
        "waves": max(w for _, _, w in placed) + 1, "state": "running", "created_at": now, "created_by": created_by,
    }, placed)
    _log.info("rollout %s: %s to %d devices in %d waves", rollout_id, facts.image_version, len(placed),
              max(w for _, _, w in placed) + 1)
    return rollout_id


def phase_of(device: dict[str, Any]) -> str:
    """What a device of a rollout is doing, for people: its newest OTA phase, else sent / pending / skipped."""
    if device["ota_phase"] is not None:
        return device["ota_phase"]
    if device["outcome"] == "skipped":
        return "skipped"
    return "sent" if device["sent_at"] is not None else "pending"


def view(store: Store, rollout_id: str, *, with_devices: bool = True) -> dict[str, Any] | None:
    """A rollout as the API shows it: its row (less the driver's lease), counts by phase, and its devices."""
    row = store.rollout(rollout_id)
    if row is None:
        return None
    devices = store.rollout_devices(rollout_id)
    shown = [{"site": x["site"], "device": x["device"], "wave": x["wave"], "phase": phase_of(x),
              "detail": x["ota_detail"] or "", "progress": x["ota_progress"], "outcome": x["outcome"],
              "sent_at": x["sent_at"], "updated_at": x["ota_at"]} for x in devices]
    counts: dict[str, int] = {}
    for x in shown:
        counts[x["phase"]] = counts.get(x["phase"], 0) + 1
    out = {k: v for k, v in row.items() if k not in ("driver", "driver_until", "signature")}
    out["counts"] = counts
    if with_devices:
        out["devices"] = shown
    return out


# ---------------------------------------------------------------- the driver


class RolloutDriver:
    """Takes every running rollout forward; one thread, woken by the recorder and every ``poll_s``."""

    def __init__(self, store: Store, publish: Callable[[OtaCommand], bool], *, owner: str, poll_s: float = 2.0,
                 lease_s: float = 30.0, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.publish = publish
        self.owner = owner
        self.poll_s = poll_s
        self.lease_s = lease_s
        self.clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cloud-rollouts", daemon=True)
        self._thread.start()

    def notify(self, *_: object) -> None:
        """Look again now (the recorder calls this for every stored OTA status)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(15)
            self._thread = None
        self.store.release_rollouts(self.owner)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.step()
            except Exception:
                _log.exception("rollout step failed; trying again in %g s", self.poll_s)
            self._wake.wait(self.poll_s)

    def step(self) -> None:
        """One step of every running rollout this process may drive."""
        for row in self.store.rollouts(1000, state="running"):
            if self._stop.is_set():
                return
            self.advance(row["id"])

    def advance(self, rollout_id: str) -> None:
        """Take one rollout as far as it goes now (sends, outcomes, next wave, end), if this process holds it."""
        with self._lock:
            if self.store.claim_rollout(rollout_id, self.owner, self.lease_s, now=self.clock()):
                self._apply(rollout_id)

    def _apply(self, rollout_id: str) -> None:
        rollout = self.store.rollout(rollout_id)
        if rollout is None or rollout["state"] != "running":
            return
        now = self.clock()
        d = decide(rollout, self.store.rollout_devices(rollout_id), now)
        for (site, device), outcome in d.outcomes.items():
            self.store.update_rollout_device(rollout_id, site, device, outcome=outcome, outcome_at=now)
            _log.info("rollout %s: %s/%s %s", rollout_id, site, device, outcome)
        if d.state != "running":
            for site, device in d.skip:
                self.store.update_rollout_device(rollout_id, site, device, outcome="skipped", outcome_at=now)
            self.store.update_rollout(rollout_id, state=d.state, reason=d.reason, finished_at=now)
            (_log.warning if d.state == "aborted" else _log.info)("rollout %s %s: %s", rollout_id, d.state, d.reason)
            return
        if d.wave_started:
            self.store.update_rollout(rollout_id, wave=d.wave, wave_started_at=now)
            _log.info("rollout %s: wave %d of %d starts", rollout_id, d.wave + 1, rollout["waves"])
        grants = rollout["target"].get("rollback") or {}  # a signed rollback: one operator grant per device
        for site, device in d.send:
            grant = grants.get(f"{site}/{device}")
            cmd = OtaCommand(site=site, device=device, image_version=rollout["image_version"], url=rollout["url"],
                             sha256=rollout["sha256"], signature=rollout["signature"], size=rollout["size"],
                             rollback=RollbackGrant.model_validate(grant) if grant else None)
            sent_at = self.clock()  # before publishing: every status of this command arrives after it
            if self.publish(cmd):
                self.store.update_rollout_device(rollout_id, site, device, sent_at=sent_at)
            else:  # no broker now: the next step sends it again
                _log.warning("rollout %s: the OTA command to %s/%s was not acknowledged; will retry", rollout_id,
                             site, device)
