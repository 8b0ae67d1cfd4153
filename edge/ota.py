"""Over-the-air updates on the device: download, verify, install into the idle slot, switch, check, commit or roll back.

The device keeps two slots, ``a`` and ``b``, under ``state_dir/slots``; ``state_dir/boot.json``
says which one is active, which one was active before, and whether the active one is
still on *trial* (switched to but not yet committed). Every change of ``boot.json`` is
one ``os.replace`` of an fsynced file, so after a power cut it is either the old or the
new state, and the boot rule makes both safe: a slot still on trial at start-up never
passed its health check, so :meth:`OtaUpdater.recover` reverts to the previous slot.

One update (:meth:`OtaUpdater.handle`), each phase reported as ``OtaStatus`` on
``topics.ota_status``:

    received -> downloading (HTTP Range resumes a kept ``.part`` file) -> downloaded
    -> verified (archive sha256, Ed25519 signature, model sha256; nothing is unpacked before)
    -> installed (into the inactive slot) -> health_check (after the atomic switch, on trial)
    -> committed | rolled_back
    or: refused (untrusted image, a downgrade, too large, not enough disk) | failed (download)
        | deferred (the battery is too low now; the ``.part`` file is kept for later)

Before a byte is written the command must pass the device's own limits: its version may not
be older than the running image's (anti-rollback; see :func:`version_key`) unless it carries an
operator's rollback grant that verifies (:class:`RollbackLedger`, :meth:`OtaUpdater._rollback_refusal`), its size not
above ``max_image_bytes`` (the stream is cut at the announced size too), and the disk must
hold the rest of the download and the unpacked model with ``min_free_bytes`` to spare.
Downloaded bytes are kept only to resume the same image: a refused or failed-for-good
download is deleted, and a command for another image deletes what others left behind.

The currently active slot is never written during an update, so a refused image, a
failed download or a failed health check all leave the device running what it ran.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from apiary.shared import image, topics
from apiary.shared.logs import get_logger
from apiary.shared.protocol import OtaCommand, OtaStatus, SensorEvent, Severity, make

log = get_logger("apiary.edge.ota")

SLOTS = ("a", "b")
FINAL_PHASES = frozenset({"committed", "rolled_back", "refused", "failed", "deferred"})  # what a rollout waits for
MAX_UNSENT = 8  # final statuses (of as many image versions) kept while the link is down
BOOT_FILE = "boot.json"
NONCE_FILE = "rollback-nonces.json"
MAX_GRANT_S = 30 * 86400  # a rollback grant valid for longer is refused (the ledger keeps each nonce that long)


class HealthCheckFailed(Exception):
    """The freshly installed model did not load or did not answer the probe within its budget."""


class DownloadFailed(Exception):
    """The image could not be fetched completely (the partial file is kept for the next try)."""


class DownloadDeferred(Exception):
    """The download stopped because the device must not spend the energy now (the partial file is kept)."""


class Publisher(Protocol):
    def publish(self, topic: str, env: Any, *, qos: int = 1, retain: bool = False, timeout: float | None = None) -> bool: ...


HealthCheck = Callable[[Path, image.Manifest], str]  # returns a short detail, raises HealthCheckFailed
Deferral = Callable[[], str | None]  # why an update must wait now (e.g. a low battery), None: go on


def version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    """Order image versions: runs of digits compare as numbers, runs of letters as text, in order.

    ``2026.2.0 < 2026.12.0``, ``v9 < v10``; a version that extends another sorts after it
    (``1.0 < 1.0.1``, and also ``1.0.0 < 1.0.0-rc1``: name pre-releases below their release).
    """
    return tuple((1, int(p)) if p.isdigit() else (0, p) for p in re.findall(r"\d+|[A-Za-z]+", version))


def is_older(version: str, than: str) -> bool:
    return version_key(version) < version_key(than)


# ---------------------------------------------------------------- boot state


@dataclass(frozen=True, slots=True)
class BootState:
    active: str | None = None  # slot name, None: no image installed (the agent's built-in model)
    previous: str | None = None  # slot to fall back to; None once it is being overwritten
    trial: bool = False  # active slot switched to but not committed yet

    def to_json(self) -> bytes:
        return json.dumps({"active": self.active, "previous": self.previous, "trial": self.trial}).encode()


class SlotStore:
    """The two slots and the boot pointer, with crash-safe writes."""

    def __init__(self, state_dir: str | Path) -> None:
        self.root = Path(state_dir)
        (self.root / "slots").mkdir(parents=True, exist_ok=True)
        (self.root / "downloads").mkdir(parents=True, exist_ok=True)

    @property
    def boot_file(self) -> Path:
        return self.root / BOOT_FILE

    def slot_dir(self, slot: str) -> Path:
        return self.root / "slots" / slot

    def read(self) -> BootState:
        try:
            doc = json.loads(self.boot_file.read_bytes())
            state = BootState(active=doc.get("active"), previous=doc.get("previous"), trial=bool(doc.get("trial")))
        except FileNotFoundError:
            return BootState()
        except (OSError, ValueError, AttributeError) as e:  # never happens with atomic writes; be safe anyway
            log.error("unreadable %s (%s): booting the built-in model", self.boot_file, e)
            return BootState()
        valid = {s for s in (state.active, state.previous) if s is None or s in SLOTS}
        return state if valid == {state.active, state.previous} else BootState()

    def write(self, state: BootState) -> None:
        """Replace boot.json atomically and durably: a power cut leaves the old or the new state."""
        image.write_durable(self.boot_file, state.to_json(), sync_dir=True)

    def manifest(self, slot: str | None) -> image.Manifest | None:
        if slot is None:
            return None
        try:
            return image.read_installed(self.slot_dir(slot))
        except image.ImageError:
            return None

    def inactive(self, state: BootState) -> str:
        return "b" if state.active == "a" else "a"


class RollbackLedger:
    """The nonces of the rollback grants this device used, each kept until its grant expires (a grant can then no
    longer pass anyway), so a grant installs at most once however often its command is replayed. Written like
    ``boot.json``: one atomic, fsynced replace."""

    def __init__(self, root: Path) -> None:
        self.path = root / NONCE_FILE

    def _read(self) -> dict[str, int]:
        try:
            doc = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:  # never with atomic writes; refuse rollbacks rather than forget nonces
            raise OSError(f"unreadable {self.path.name}: {e}") from None
        return {str(k): int(v) for k, v in doc.items()} if isinstance(doc, dict) else {}

    def spent(self, nonce: str) -> bool:
        return nonce in self._read()

    def spend(self, nonce: str, expires: int, now: float) -> None:
        kept = {n: e for n, e in self._read().items() if e >= now}
        kept[nonce] = expires
        image.write_durable(self.path, json.dumps(kept, sort_keys=True).encode(), sync_dir=True)


# ---------------------------------------------------------------- download


def download(client: Any, url: str, part: Path, size: int, on_progress: Callable[[int], None] | None = None) -> None:
    """Fetch ``url`` into ``part``, continuing from its current length with an HTTP Range request.

    Raises :class:`DownloadFailed` when the transfer stops early (the bytes so far stay in
    ``part``) and :class:`image.ImageError` ("hash") when the server sends more than ``size``.
    """
    import httpx

    offset = part.stat().st_size if part.exists() else 0
    if offset > size:
        part.unlink()
        offset = 0
    if offset == size:
        return
    headers = {"Accept-Encoding": "identity", **({"Range": f"bytes={offset}-"} if offset else {})}
    try:
        with client.stream("GET", url, headers=headers) as r:
            if r.status_code == 206 and offset:
                content_range = r.headers.get("content-range", "")
                if not content_range.startswith(f"bytes {offset}-"):
                    raise DownloadFailed(f"server answered range {content_range!r} for bytes={offset}-")
                mode = "ab"
            elif r.status_code == 200:
                offset, mode = 0, "wb"  # the server ignored the range: start over
            elif r.status_code == 416:
                part.unlink(missing_ok=True)
                raise DownloadFailed("server refused the resume range; restarting")
            else:
                raise DownloadFailed(f"HTTP {r.status_code} for {url}")
            with open(part, mode) as f:
                try:
                    for chunk in r.iter_raw():  # as received: nothing buffered is lost when the link drops
                        if offset + len(chunk) > size:
                            raise image.ImageError("hash", f"server sent more than the announced {size} bytes")
                        f.write(chunk)
                        offset += len(chunk)
                        if on_progress:
                            on_progress(offset)
                finally:
                    f.flush()
                    os.fsync(f.fileno())
    except httpx.HTTPError as e:
        raise DownloadFailed(f"transfer interrupted at {offset}/{size} bytes: {e.__class__.__name__}: {e}") from None
    if offset != size:
        raise DownloadFailed(f"transfer ended at {offset}/{size} bytes")


# ---------------------------------------------------------------- health check


PROBE_EVENT = SensorEvent(  # a plain heat-stress case, in the simulator's reading names
    site="ota", device="probe", seq=0, timestamp=0.0, severity=Severity.CRITICAL,
    readings={"hive_temp_c": 40.8, "hive_humidity_pct": 36.0, "ambient_temp_c": 39.5, "hive_weight_kg": 47.9,
              "acoustic_db": 64.0, "acoustic_freq_hz": 290.0, "bee_traffic": 850.0, "battery_v": 4.1, "solar_w": 6.0},
    flags=["hive_temp_c_high", "ambient_temp_c_high"],
)


def probe_model(model_path: str | Path, *, max_tokens: int = 96, threads: int = 2, n_ctx: int = 2048) -> dict[str, Any]:
    """Load a model and answer the probe event with it (:func:`probe`)."""
    from apiary.edge.model import LocalModel

    t0 = time.perf_counter()
    model = LocalModel(model_path, n_ctx=n_ctx, threads=threads)
    try:
        return {**probe(model, max_tokens=max_tokens), "load_s": time.perf_counter() - t0}
    finally:
        model.close()


def probe(model: Any, *, max_tokens: int = 96) -> dict[str, Any]:
    """Answer the probe event the way the agent answers events (a loaded ``apiary.edge.model.LocalModel``, shared
    prompt in the model's own style, shared parser)."""
    from apiary.shared.prompting import build_messages, parse_action

    t0 = time.perf_counter()
    gen = model.generate(build_messages(PROBE_EVENT, style=model.prompt_style), max_tokens=max_tokens)
    action = parse_action(gen.text)
    return {"text": gen.text, "finished": gen.finished, "completion_tokens": gen.completion_tokens, "load_s": 0.0,
            "answer_s": time.perf_counter() - t0, "prompt_style": model.prompt_style,
            "action": action.model_dump(mode="json") if action else None}


def judge_probe(result: dict[str, Any], *, max_tokens: int, expect_assessment: str | None = None) -> str:
    """The verdict on a :func:`probe` result: its detail, or :class:`HealthCheckFailed` with the reason."""
    if not result["finished"]:
        raise HealthCheckFailed(f"answer did not finish within {max_tokens} tokens")
    action = result["action"]
    if action is None:
        raise HealthCheckFailed(f"answer is not a valid action: {result['text'][:120]!r}")
    if expect_assessment and action["assessment"] != expect_assessment:
        raise HealthCheckFailed(f"probe answered {action['assessment']}, expected {expect_assessment}")
    return (f"probe answered {action['assessment']}/{action['urgency']} in {result['completion_tokens']} tokens "
            f"(load {result['load_s']:.2f} s, answer {result['answer_s']:.2f} s)")


@dataclass(slots=True)
class LlamaHealthCheck:
    """The new model must load and answer the probe event with a valid action, within a time and token budget.

    It runs in a child process: a corrupt GGUF can abort llama.cpp, which must not take the
    agent down, and the time budget is enforced by killing the child. ``expect_assessment``
    additionally requires the right answer (off by default: a 135M model's judgement is
    not what this check is about; a broken file or runtime is).
    """

    budget_s: float = 120.0
    max_tokens: int = 96
    expect_assessment: str | None = None

    def __call__(self, model_path: Path, manifest: image.Manifest) -> str:
        profile = manifest.power_profile
        cmd = [sys.executable, "-m", "apiary.edge.ota", str(model_path), "--max-tokens", str(self.max_tokens),
               "--n-ctx", str(int(profile.get("n_ctx", 2048))), "--threads", str(int(profile.get("threads", 2)))]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.budget_s)
        except subprocess.TimeoutExpired:
            raise HealthCheckFailed(f"probe did not answer within {self.budget_s:.0f} s") from None
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise HealthCheckFailed(f"model failed to load or answer (exit {proc.returncode}): {tail[0][:200]}")
        try:
            result = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise HealthCheckFailed("probe printed no result") from None
        return judge_probe(result, max_tokens=self.max_tokens, expect_assessment=self.expect_assessment)


# ---------------------------------------------------------------- the updater


class OtaUpdater:
    """Applies OTA commands for one device; construct once at agent start (it runs the boot rule).

    ``transport`` is anything with ``publish(topic, envelope, qos=...)`` (the mesh's
    ``MqttTransport``) or None. ``handle`` blocks for the whole update (download + health
    check): call it from a worker thread, never from the MQTT network thread.
    """

    def __init__(self, state_dir: str | Path, transport: Publisher | None, site: str, device: str,
                 public_key: str | bytes | Path, *, health_check: HealthCheck | None = None,
                 http_client: Any = None, max_attempts: int = 5, retry_delay_s: float = 1.0,
                 http_timeout_s: float = 30.0, max_image_bytes: int | None = None, min_free_bytes: int = 0,
                 defer: Deferral | None = None, builtin_version: str | None = None,
                 operator_keys: list[str | bytes | Path] = (), clock: Callable[[], float] = time.time) -> None:
        """``max_image_bytes``: larger commands are refused (None: no limit); ``min_free_bytes``: what the
        disk must still hold after the download and the unpacked model; ``defer``: asked before and during
        a download; ``builtin_version``: the image the built-in model came from, the version floor while
        no slot is active (None: unknown, any version may install); ``operator_keys``: the Ed25519 keys whose
        rollback grants may take the device to an older image (none: never)."""
        self.store = SlotStore(state_dir)
        self.transport, self.site, self.device = transport, site, device
        self.public_key = image.load_public_key(public_key)  # fail at start-up, not during an update
        self.health_check = health_check or LlamaHealthCheck()
        self.max_attempts, self.retry_delay_s, self.http_timeout_s = max_attempts, retry_delay_s, http_timeout_s
        self.max_image_bytes, self.min_free_bytes = max_image_bytes, min_free_bytes
        self.defer = defer or (lambda: None)
        self.builtin_version = builtin_version
        self.operator_keys = [image.load_public_key(k) for k in operator_keys]  # fail at start-up too
        self.clock = clock
        self.ledger = RollbackLedger(self.store.root)
        self._client = http_client
        self._lock = threading.Lock()
        self._status_lock = threading.Lock()  # final statuses go out in order, also when sent again
        self._unsent: dict[str, OtaStatus] = {}  # per image version, the newest final status the link did not take
        self.boot_status: OtaStatus | None = self.recover()

    # -- what the agent runs

    def active_model_path(self) -> Path | None:
        """The model the agent should load now; None: no image installed, use the built-in model."""
        state = self.store.read()
        manifest = self.store.manifest(state.active)
        return None if manifest is None else self.store.slot_dir(state.active) / manifest.model.filename

    def active_manifest(self) -> image.Manifest | None:
        return self.store.manifest(self.store.read().active)

    def active_version(self) -> str | None:
        m = self.active_manifest()
        return m.image_version if m else None

    def running_version(self) -> str | None:
        """The image version the device runs: the active slot's, else the built-in model's (if known)."""
        return self.active_version() or self.builtin_version

    # -- boot rule

    def recover(self) -> OtaStatus | None:
        """Make the boot state bootable: revert an uncommitted trial slot, drop a slot that is not intact."""
        state = self.store.read()
        if state.trial:
            fallback = state.previous if self.store.manifest(state.previous) else None
            self.store.write(BootState(active=fallback, previous=None, trial=False))
            trial_manifest = self.store.manifest(state.active)
            version = trial_manifest.image_version if trial_manifest else "unknown"
            log.warning("slot %s was still on trial at start-up: reverted to %s", state.active, fallback or "built-in")
            return self._status(version, "rolled_back", f"slot {state.active} never committed (restart during its "
                                f"trial); reverted to {fallback or 'the built-in model'}", slot=fallback)
        if state.active is not None and self.store.manifest(state.active) is None:
            fallback = state.previous if self.store.manifest(state.previous) else None
            self.store.write(BootState(active=fallback, previous=None, trial=False))
            log.error("active slot %s is not intact: reverted to %s", state.active, fallback or "built-in")
        return None

    def announce_boot(self) -> None:
        """Publish what :meth:`recover` did at start-up, and the final status of an update that ended while the link
        was down (a rollout waits for it). Call whenever the link is (back) up."""
        boot, self.boot_status = self.boot_status, None
        if boot is not None:
            self._publish(boot)
        with self._status_lock:
            unsent, self._unsent = list(self._unsent.values()), {}
            for status in unsent:
                log.info("sending the OTA status %s of %s again: the link was down when it ended", status.phase,
                         status.image_version)
                self._send(status)

    # -- one update

    def handle(self, cmd: OtaCommand) -> OtaStatus:
        """Run one OTA command to its end and return the final status (also published). Never raises."""
        with self._lock:
            try:
                return self._handle(cmd)
            except Exception as e:  # a bug or an I/O error: report it, keep the device running
                log.exception("OTA update %s failed unexpectedly", cmd.image_version)
                self._discard(self._archive(cmd))  # what it left is not worth resuming
                return self._report(cmd, "failed", f"unexpected error: {e.__class__.__name__}: {e}")

    def _handle(self, cmd: OtaCommand) -> OtaStatus:
        if (cmd.site, cmd.device) != (self.site, self.device):
            return self._report(cmd, "refused", f"command is for {cmd.site}/{cmd.device}, not this device")
        self._report(cmd, "received", f"{cmd.size} bytes from {cmd.url}")
        state = self.store.read()
        current = self.store.manifest(state.active)
        if current and current.image_version == cmd.image_version and not state.trial:
            return self._report(cmd, "committed", "already running this image", slot=state.active)

        archive = self._archive(cmd)
        self._sweep_downloads(keep=archive)
        refusal = self._refusal(cmd, archive)
        if refusal is not None:
            self._discard(archive)
            return self._report(cmd, "refused", refusal)
        why = self.defer()
        if why is not None:
            return self._report(cmd, "deferred", f"{why}; taken up again when it recovers")
        try:
            self._fetch(cmd, archive)
        except DownloadFailed as e:
            return self._report(cmd, "failed", f"download failed, partial file kept for resume: {e}")
        except DownloadDeferred as e:
            return self._report(cmd, "deferred", f"download paused, partial file kept for resume: {e}")
        except image.ImageError as e:
            self._discard(archive)
            return self._report(cmd, "refused", f"{e.reason}: {e}")
        except OSError as e:  # the disk filled up under us (other writers), or it failed
            self._discard(archive)
            return self._report(cmd, "failed", f"could not store the download: {e}")
        self._report(cmd, "downloaded", f"{cmd.size} bytes", progress=1.0)

        try:
            info = image.verify_image(archive, self.public_key, expected_sha256=cmd.sha256,
                                      expected_signature=cmd.signature, expected_version=cmd.image_version)
        except image.ImageError as e:
            self._discard(archive)
            return self._report(cmd, "refused", f"{e.reason}: {e}")
        self._report(cmd, "verified", f"signature and hashes ok; model {info.manifest.model.filename}"
                     + (" (operator-signed rollback)" if cmd.rollback else ""))
        if cmd.rollback is not None:  # spent from here on: the slots change for it
            self.ledger.spend(cmd.rollback.nonce, cmd.rollback.expires, self.clock())

        target, old = self.store.inactive(state), state.active
        if state.previous == target:  # the fallback slot is about to be overwritten: stop pointing at it
            self.store.write(BootState(active=old, previous=None, trial=False))
        try:
            image.unpack_image(archive, self.store.slot_dir(target), self.public_key, expected_sha256=cmd.sha256,
                               expected_signature=cmd.signature, expected_version=cmd.image_version)
        except image.ImageError as e:
            return self._report(cmd, "refused", f"{e.reason}: {e}")
        self._discard(archive)
        self._report(cmd, "installed", f"unpacked into slot {target}", slot=target)

        self.store.write(BootState(active=target, previous=old, trial=True))  # the atomic switch
        model = self.store.slot_dir(target) / info.manifest.model.filename
        self._report(cmd, "health_check", f"switched to slot {target} on trial", slot=target)
        try:
            detail = self.health_check(model, info.manifest)
        except Exception as e:  # HealthCheckFailed, or a crash in a custom check: either way, not healthy
            self.store.write(BootState(active=old, previous=None, trial=False))
            why = str(e) if isinstance(e, HealthCheckFailed) else f"{e.__class__.__name__}: {e}"
            return self._report(cmd, "rolled_back", f"health check failed: {why}; back on "
                                f"{'slot ' + old if old else 'the built-in model'}", slot=old)
        self.store.write(BootState(active=target, previous=old, trial=False))
        return self._report(cmd, "committed", detail, slot=target)

    def _archive(self, cmd: OtaCommand) -> Path:
        return self.store.root / "downloads" / f"{cmd.image_version}-{cmd.sha256[:16]}.tar"

    def _sweep_downloads(self, keep: Path) -> None:
        """Delete what downloads of other images left (a partial file is resumed only by its own image)."""
        for path in (self.store.root / "downloads").iterdir():
            if path not in (keep, keep.with_name(keep.name + ".part")) and path.is_file():
                log.info("removing %s: left by an update to another image", path.name)
                path.unlink(missing_ok=True)

    def _refusal(self, cmd: OtaCommand, archive: Path) -> str | None:
        """Why the device will not take this image whatever its signature says, checked before any download."""
        running = self.running_version()
        if cmd.rollback is not None:
            why = self._rollback_refusal(cmd)
            if why is not None:
                return why
        elif running is not None and is_older(cmd.image_version, running):
            return (f"downgrade: {cmd.image_version} is older than the running {running} (anti-rollback: going back "
                    f"takes a rollback command signed by an operator key this device trusts, `apiary image rollback`)")
        if self.max_image_bytes is not None and cmd.size > self.max_image_bytes:
            return f"too large: {cmd.size} bytes, this device takes images up to {self.max_image_bytes} bytes"
        part = archive.with_name(archive.name + ".part")
        have = next((p.stat().st_size for p in (archive, part) if p.is_file()), 0)
        to_download = max(0, cmd.size - have)
        slot = self.store.slot_dir(self.store.inactive(self.store.read()))
        reclaimed = sum(p.stat().st_size for p in slot.iterdir() if p.is_file()) if slot.is_dir() else 0
        to_unpack = max(0, cmd.size - reclaimed)  # unpacking replaces the inactive slot's files
        need = to_download + to_unpack + self.min_free_bytes
        free = shutil.disk_usage(self.store.root).free
        if free < need:
            return (f"disk: {free} bytes free, the update needs {need} ({to_download} to download, {to_unpack} to "
                    f"unpack, {self.min_free_bytes} kept free for the device's store)")
        return None

    def _rollback_refusal(self, cmd: OtaCommand) -> str | None:
        """Why the operator's rollback grant on ``cmd`` does not lift the version floor (None: it does): no trusted
        operator key, a signature by none of them over this command's device, image and expiry, an expired or
        overlong grant, or a nonce this device already used."""
        grant = cmd.rollback
        assert grant is not None
        if not self.operator_keys:
            return "rollback: this device trusts no operator key ([edge.ota] operator_keys), so it takes no rollback"
        try:
            image.verify_rollback(cmd, self.operator_keys)
        except image.ImageError as e:
            return f"rollback: {e}"
        now = self.clock()
        if grant.expires <= now:
            return f"rollback: the grant expired {now - grant.expires:.0f} s ago"
        if grant.expires - now > MAX_GRANT_S:
            return (f"rollback: the grant is valid for {(grant.expires - now) / 86400:.0f} days, more than the "
                    f"{MAX_GRANT_S // 86400} this device accepts")
        if self.ledger.spent(grant.nonce):
            return f"rollback: nonce {grant.nonce} was used before (a replayed command)"
        return None

    def _fetch(self, cmd: OtaCommand, archive: Path) -> None:
        if archive.is_file() and archive.stat().st_size == cmd.size:
            return  # fetched before (e.g. a restart between download and verify)
        part = archive.with_name(archive.name + ".part")
        last = [-1.0]

        def progress(n: int) -> None:
            why = self.defer()
            if why is not None:
                raise DownloadDeferred(f"{why} at {n}/{cmd.size} bytes")
            frac = n / cmd.size if cmd.size else 1.0
            if frac - last[0] >= 0.1 or (n == cmd.size and last[0] < 1.0):
                last[0] = frac
                self._report(cmd, "downloading", f"{n}/{cmd.size} bytes", progress=min(frac, 1.0))

        client = self._client or _default_client(self.http_timeout_s)
        try:
            for attempt in range(1, self.max_attempts + 1):
                try:
                    download(client, cmd.url, part, cmd.size, progress)
                    break
                except DownloadFailed as e:
                    if attempt == self.max_attempts:
                        raise
                    kept = part.stat().st_size if part.exists() else 0
                    log.warning("download attempt %d failed (%s); resuming from byte %d", attempt, e, kept)
                    time.sleep(self.retry_delay_s * 2 ** (attempt - 1))
        finally:
            if self._client is None:
                client.close()
        os.replace(part, archive)

    def _discard(self, archive: Path) -> None:
        archive.unlink(missing_ok=True)
        archive.with_name(archive.name + ".part").unlink(missing_ok=True)

    # -- status

    def _status(self, version: str, phase: str, detail: str, progress: float | None = None,
                slot: str | None = None) -> OtaStatus:
        return OtaStatus(site=self.site, device=self.device, image_version=version, phase=phase,  # type: ignore[arg-type]
                         detail=detail[:500], progress=progress, slot=slot)

    def _report(self, cmd: OtaCommand, phase: str, detail: str = "", progress: float | None = None,
                slot: str | None = None) -> OtaStatus:
        status = self._status(cmd.image_version, phase, detail, progress, slot)
        (log.warning if phase in ("refused", "failed", "rolled_back") else log.info)(
            "ota %s %s: %s", cmd.image_version, phase, detail)
        self._publish(status)
        return status

    def _publish(self, status: OtaStatus) -> None:
        """Progress is best effort; a final status the link does not take is kept and sent at the next
        :meth:`announce_boot` (per image version the newest: it supersedes an older one of that version)."""
        if status.phase not in FINAL_PHASES:
            self._send(status)
            return
        with self._status_lock:
            self._unsent.pop(status.image_version, None)
            self._send(status)

    def _send(self, status: OtaStatus) -> None:
        """Publish ``status``; a final one not taken is kept in ``_unsent`` (call it under ``_status_lock``)."""
        if self.transport is None:
            return
        try:
            taken = self.transport.publish(topics.ota_status(self.site, self.device),
                                           make(status, sender=self.device), qos=1)
        except Exception as e:  # the update itself must go on
            log.warning("could not publish OTA status %s: %s", status.phase, e)
            taken = False
        if not taken and status.phase in FINAL_PHASES:
            self._unsent[status.image_version] = status
            while len(self._unsent) > MAX_UNSENT:  # the oldest versions' first
                self._unsent.pop(next(iter(self._unsent)))
            log.warning("OTA status %s of %s not sent (the link is down); sent when it is back", status.phase,
                        status.image_version)


def _default_client(timeout_s: float) -> Any:
    import httpx

    return httpx.Client(timeout=httpx.Timeout(timeout_s), follow_redirects=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m apiary.edge.ota MODEL``: run the health probe once and print its result as one JSON line."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("model")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    result = probe_model(args.model, max_tokens=args.max_tokens, threads=args.threads, n_ctx=args.n_ctx)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
