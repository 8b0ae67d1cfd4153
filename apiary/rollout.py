"""The mesh's OTA rollout: a signed image of the edges' own model, rolled out through the cloud's REST API.

At the mesh's start a demo key pair is written into the run folder (the edge agents trust its public
key for OTA), and a background thread packs the model the edges run into a signed image with a version
above the shipped one, into the cloud's images directory (so the first answers never wait for it).
Later, :meth:`MeshRollout.start` asks the cloud for a rollout to every edge device (``POST
/v1/fleet/rollouts``: a canary wave, then the rest); :meth:`MeshRollout.poll` follows it with ``GET``,
exactly as ``apiary image rollout`` does, and :meth:`MeshRollout.summary` says how it ended.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from apiary.shared import image
from apiary.shared.logs import get_logger

log = get_logger("apiary.rollout")
RETRY_STATUSES = (404, 503)  # the cloud does not know the devices yet, or its broker link is still coming up


def demo_version(model: Path) -> str:
    """A version above the image the model was unpacked from (the shipped student's), e.g. 2026.12.0-demo."""
    try:
        shipped = image.read_installed(model.parent).image_version
    except image.ImageError:
        shipped = "0"
    return f"{shipped}-demo"


class MeshRollout:
    """One rollout of a freshly signed image to the whole mesh; thread-safe to poll from a view loop."""

    def __init__(self, run_dir: Path, images_dir: Path, model: Path, *, canary: float = 0.2,
                 wave_timeout_s: float = 600.0, threads: int = 1) -> None:
        self.run_dir, self.images_dir, self.model = run_dir, images_dir, model
        self.canary, self.wave_timeout_s, self.threads = canary, wave_timeout_s, threads
        self.version = demo_version(model)
        self.private_key, public = image.write_keypair(run_dir / "keys", "demo-image")
        self.public_key = public.read_text().strip()  # what the edge agents trust ([edge.ota] public_key)
        self.info: image.ImageInfo | None = None
        self.build_error: str | None = None
        self.build_s: float | None = None
        self.error: str | None = None  # the cloud refused the rollout
        self.id: str | None = None
        self.state: dict[str, Any] | None = None  # the newest GET /v1/fleet/rollouts/{id}
        self.started_at: float | None = None  # wall clock, when the cloud accepted it
        self._built = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def filename(self) -> str:
        return f"edge-{self.version}.tar"

    def build_in_background(self) -> None:
        self._thread = threading.Thread(target=self._build, name="image-build", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        """Sign the edges' model under a new file name (answers then name the model they came from)."""
        t0 = time.monotonic()
        try:
            src = self.run_dir / "image-src" / f"edge-student-{self.version}.gguf"
            src.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(self.model, src)  # same bytes, no copy
            except OSError:
                shutil.copyfile(self.model, src)
            self.images_dir.mkdir(parents=True, exist_ok=True)
            self.info = image.build_image(self.images_dir / self.filename, src, self.version, self.private_key,
                                          power_profile={"name": "demo", "threads": self.threads, "n_ctx": 2048})
            self.build_s = time.monotonic() - t0
        except (image.ImageError, OSError) as e:
            self.build_error = f"could not build the demo image: {e}"
            log.error("%s", self.build_error)
        finally:
            self._built.set()

    @property
    def ready(self) -> bool:
        return self.info is not None

    @property
    def settled(self) -> bool:
        """Nothing more will happen: never started, refused, or the cloud says it ended."""
        if self.id is None:
            return True
        return self.state is not None and self.state["state"] != "running"

    def start(self, cloud_url: str, api_key: str) -> bool:
        """Ask the cloud for the rollout; True once it accepted (or refused for good), False to try again later."""
        if self.id is not None or self.error is not None:
            return True
        if self.build_error is not None:
            self.error = self.build_error
            return True
        if self.info is None or not cloud_url:
            return False
        body = {"filename": self.filename, "all": True, "canary": self.canary, "max_failed_pct": 0,
                "wave_timeout_s": self.wave_timeout_s, "sha256": self.info.sha256}
        try:
            r = httpx.post(f"{cloud_url}/v1/fleet/rollouts", json=body, timeout=30,
                           headers={"Authorization": f"Bearer {api_key}"})
        except httpx.HTTPError as e:
            log.warning("rollout request failed (%s); trying again", e)
            return False
        if r.status_code in RETRY_STATUSES:
            return False
        if r.status_code != 201:
            self.error = f"the cloud refused the rollout ({r.status_code}): {r.text[:300]}"
            log.error("%s", self.error)
            return True
        self.state, self.id, self.started_at = r.json(), r.json()["id"], time.time()
        return True

    def poll(self, cloud_url: str, api_key: str) -> dict[str, Any] | None:
        """The rollout as the cloud shows it now (the last known state if the cloud does not answer)."""
        if self.id is None or self.settled:
            return self.state
        try:
            r = httpx.get(f"{cloud_url}/v1/fleet/rollouts/{self.id}", timeout=5,
                          headers={"Authorization": f"Bearer {api_key}"})
            if r.status_code == 200:
                self.state = r.json()
        except httpx.HTTPError:
            pass
        return self.state

    def summary(self) -> dict[str, Any]:
        """How the rollout went: state, the cloud's reason, devices by outcome, its waves and how long it took."""
        out: dict[str, Any] = {"image_version": self.version, "filename": self.filename, "build_s": self.build_s,
                               "started": self.id is not None, "error": self.error}
        if self.state is None:
            return {**out, "state": "not started"}
        devices = self.state.get("devices", [])
        outcomes: dict[str, int] = {}
        for d in devices:
            key = d["outcome"] or d["phase"]
            outcomes[key] = outcomes.get(key, 0) + 1
        finished = self.state.get("finished_at")
        return {**out, "id": self.id, "state": self.state["state"], "reason": self.state["reason"],
                "devices": len(devices), "waves": self.state["waves"],
                "canary": [f"{d['site']}/{d['device']}" for d in devices if d["wave"] == 0],
                "committed": outcomes.get("committed", 0),
                "rolled_back": sum(d["phase"] == "rolled_back" for d in devices),
                "outcomes": outcomes, "created_at": self.state["created_at"], "finished_at": finished,
                "seconds": None if finished is None else finished - self.state["created_at"]}


def summary_rows(r: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(measure, value) rows about a rollout's :meth:`MeshRollout.summary` (with its events' ``during`` window),
    for the demo's summary and the mesh benchmark's table."""
    if r is None:
        return []
    if not r["started"]:
        return [(f"rollout of {r['image_version']}", r["error"] or "not started (the traffic ended first)")]
    during = r.get("during") or {}
    took = "" if r["seconds"] is None else f" ({r['seconds']:.0f} s)"
    return [
        (f"rollout of {r['image_version']}", f"{r['state']} in {r['waves']} waves{took}"),
        ("devices committed / rolled back / all", f"{r['committed']} / {r['rolled_back']} / {r['devices']}"),
        ("events during the rollout (needing an answer)", f"{during.get('events', 0)} "
                                                          f"({during.get('needing_answer', 0)})"),
        ("  lost (no answer) / answered twice", f"{during.get('unanswered', 0)} / {during.get('double_answers', 0)}"),
        ("  answered by model", ", ".join(f"{m} {n}" for m, n in sorted((during.get("models") or {}).items()))
                                or "-"),
    ]
