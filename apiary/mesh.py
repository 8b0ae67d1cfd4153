"""The whole mesh on one machine: broker, cloud service, edge agents, bridge and simulator.

Used by ``apiary demo`` (with a live view) and ``apiary bench mesh`` (at a fixed rate,
with a broker restart). The cloud service and every edge agent run as their own
processes, exactly as ``apiary cloud serve`` / ``apiary edge run`` would on their own
machines; the simulator drives an in-process bridge through real frames (UDP-style
datagrams through the frame decoder) so the injected anomalies' ground truth can be
attached to events for scoring. With ``rollout`` the edges trust a demo image key and a
signed image of their own model is built in the background, ready for :meth:`Mesh.start_rollout`
(``apiary.rollout``).
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from apiary.observer import MeshObserver
from apiary.rollout import MeshRollout
from apiary.supervisor import Supervisor
from apiary.shared import assets
from apiary.shared.brokers import EmbeddedBroker, MosquittoBroker, free_port
from apiary.shared.config import MqttConfig

HOUR = 3600.0


class MeshError(RuntimeError):
    """A component of the mesh did not come up (its log is named in the message)."""


@dataclass
class MeshOptions:
    sites: int = 3
    devices: int = 2  # hives per site
    rate: float = 2.0  # frames per second, all devices together
    interval_s: float = 300.0  # sim seconds between two frames of one device
    seed: int = 0
    anomalies_per_device: int = 1
    anomaly_window_s: float = 60.0  # wall seconds over which the injected anomalies start, spread evenly
    broker_url: str | None = None  # None: start one (embedded amqtt, or Mosquitto with use_mosquitto)
    use_mosquitto: bool = False
    results_dir: Path = Path("results/demo")
    edge_threads: int = 1  # llama.cpp threads per agent: several agents share this machine's cores
    cloud_model: str = "smollm2-135m-q4"  # the teacher's base; the cloud merges its shipped task adapter
    edge_model: str = "edge-student"  # the shipped signed edge image: the INT4 student distilled from the teacher
    cloud_dtype: str = "auto"
    startup_timeout_s: float = 300.0
    # The first anomaly a sensor fault on the first hive from its second frame (evident at once, one normal reading
    # before it as context), so a demo shows an answer seconds after its traffic starts; the others follow over
    # anomaly_window_s as before.
    early_first_anomaly: bool = False
    # Start the traffic once the edge agents are online, while the cloud may still load its model (the demo: the
    # edges answer from the first seconds); else once everything is up (the benchmark: steady-state latencies).
    traffic_before_cloud: bool = False
    # Prepare an OTA rollout (a demo key the edges trust, a signed image of their model built once the traffic runs);
    # start_rollout() then takes it to every edge device through the cloud's REST API, a canary wave first.
    rollout: bool = False
    rollout_canary: float = 0.2


@dataclass
class Mesh:
    options: MeshOptions
    supervisor: Supervisor = field(init=False)
    broker: EmbeddedBroker | MosquittoBroker | None = None
    mqtt: MqttConfig | None = None
    cloud_url: str = ""
    api_key: str = ""
    observer: MeshObserver | None = None
    rollout: MeshRollout | None = None

    def __post_init__(self) -> None:
        self.results = self.options.results_dir
        self.supervisor = Supervisor(self.results / "logs")
        self._bridge: Any = None
        self._fleet: Any = None
        self._stop_sim = threading.Event()
        self._sim_thread: threading.Thread | None = None
        self.traffic_started: float | None = None  # time.monotonic() when the simulator started sending
        self.frames_sent = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self, on_step: Any = None) -> "Mesh":
        """Bring everything up in dependency order; ``on_step(text)`` reports progress."""
        say = on_step or (lambda text: None)
        o = self.options
        self.results.mkdir(parents=True, exist_ok=True)
        # Once, before several processes would race to pull or unpack them.
        cloud_model, edge_model = assets.model_file(o.cloud_model), assets.model_file(o.edge_model)
        say(f"cloud model {cloud_model.name}, edge model {edge_model.name}")
        edge_env = {"APIARY__EDGE__THREADS": str(o.edge_threads)}
        if o.rollout:
            self.rollout = MeshRollout(self.results, self.results / "images", edge_model, canary=o.rollout_canary,
                                       threads=o.edge_threads)
            # The edges trust the demo's image key. Their update does not wait for the battery: a simulated hive
            # with a failing battery would hold its wave for longer than a demo runs.
            edge_env.update({"APIARY__EDGE__OTA__PUBLIC_KEY": self.rollout.public_key,
                             "APIARY__EDGE__OTA__MIN_SOC": "0"})
        if o.broker_url:
            self.mqtt = MqttConfig.from_url(o.broker_url)
        elif o.use_mosquitto:
            self.broker = MosquittoBroker(data_dir=self.results / "mosquitto")
            self.mqtt = self.broker.start()
        else:
            self.broker = EmbeddedBroker()
            self.mqtt = self.broker.start()
        say(f"broker {self.mqtt.url}")

        from apiary.firmware_bridge.simulator import Fleet

        self._fleet = Fleet(o.sites, o.devices, seed=o.seed, interval_s=o.interval_s)
        self._schedule_anomalies()

        self.observer = MeshObserver(self.mqtt).start()  # before any agent: it sees every birth
        port = free_port()
        cloud = self.supervisor.spawn("cloud", [
            "cloud", "serve", "--broker", self.mqtt.url, "--port", str(port), "--model", str(cloud_model),
            "--db", str(self.results / "cloud.db"), "--images", str(self.results / "images"),
            "--api-key-file", str(self.results / "cloud-keys.jsonl"), "--dtype", o.cloud_dtype])
        # The edge agents load alongside the cloud's model (each needs only the broker): start-up takes the longer
        # of the two, not their sum.
        for site, node in self.devices():
            self.supervisor.spawn(f"edge-{site}-{node}", [
                "edge", "run", "--site", site, "--device", node, "--broker", self.mqtt.url, "--model", str(edge_model),
                "--state-dir", str(self.results / "edge" / f"{site}-{node}")], env=edge_env)
        self._wait_for_edges()
        say(f"{len(self.devices())} edge agents online")
        # With traffic_before_cloud the edges answer what they can while the cloud loads, and an escalation made
        # before the cloud subscribed is re-sent by its edge (edge.resend) until answered.
        if not o.traffic_before_cloud:
            self._wait_for_cloud_step(cloud.log_path, say)
        from apiary.firmware_bridge.bridge import connect
        from apiary.firmware_bridge.settings import BridgeSettings

        self._bridge = connect(BridgeSettings(name="demo-bridge", sites=self._fleet.sites()), self.mqtt,
                               truth_lookup=self._fleet.truth)
        self._sim_thread = threading.Thread(target=self._simulate, name="simulator", daemon=True)
        self.traffic_started = time.monotonic()
        self._sim_thread.start()
        say("simulator and bridge running")
        if self.rollout is not None:  # after the first frames are out: the build never delays an answer
            self.rollout.build_in_background()
        if o.traffic_before_cloud:
            self._wait_for_cloud_step(cloud.log_path, say)
        return self

    def _wait_for_cloud_step(self, log_path: Path, say: Any) -> None:
        self.cloud_url, self.api_key = self._wait_for_cloud(log_path)
        say(f"cloud {self.cloud_url}")

    def devices(self) -> list[tuple[str, str]]:
        from apiary.firmware_bridge.settings import BridgeSettings

        names = BridgeSettings()
        return [(site, names.node_of(dev)) for dev, site in sorted(self._fleet.sites().items())]

    def stop_simulator(self) -> None:
        self._stop_sim.set()
        if self._sim_thread is not None:
            self._sim_thread.join(10)

    def outstanding(self) -> tuple[int, int]:
        """(events sent but not yet seen on the broker, events seen that need an answer and have none): what
        is left before every event is answered."""
        snap = self.observer.snapshot()
        return max(0, self.frames_sent - snap["events"]), snap["unanswered"]

    def drain(self, timeout_s: float) -> bool:
        """Wait until every frame sent arrived as an event and every event that needs an answer has one (or
        ``timeout_s`` passes); True if nothing is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.outstanding() == (0, 0):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))

    def stop(self) -> None:
        """Stop everything in the order the work flows, so nothing publishes to a component already gone: the
        traffic and the bridge, then the edge agents (their last escalations and death certificates reach a
        cloud still listening), then the cloud, the observer, the broker. Safe to call twice and after a
        failed start."""
        self.stop_simulator()
        if self._bridge is not None:
            self._bridge.stop(drain_timeout=5.0)
            self._bridge = None
        self.supervisor.stop_all(order=lambda m: m.name.startswith("edge-"))
        if self.observer is not None:
            self.observer.stop()
        if self.broker is not None:
            self.broker.stop()
            if isinstance(self.broker, MosquittoBroker):
                self.broker.close()
            self.broker = None

    def start_rollout(self) -> bool:
        """Ask the cloud to roll the demo image out (once built and the cloud is up); True once it is decided."""
        return self.rollout is None or self.rollout.start(self.cloud_url, self.api_key)

    def rollout_state(self) -> dict[str, Any] | None:
        """The rollout as the cloud shows it (None before it started)."""
        return None if self.rollout is None else self.rollout.poll(self.cloud_url, self.api_key)

    def crashed(self) -> list[str]:
        return [f"{m.name} (exit {m.proc.returncode}, log {m.log_path})" for m in self.supervisor.failed()]

    # ------------------------------------------------------------------ cloud engine numbers

    def engine_metrics(self) -> dict[str, float]:
        """The engine gauges from the cloud's Prometheus endpoint (what any operator can scrape)."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            r = httpx.get(f"{self.cloud_url}/metrics", headers={"Authorization": f"Bearer {self.api_key}"},
                          timeout=2.0)
            r.raise_for_status()
        except httpx.HTTPError:
            return {}
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(r.text):
            if fam.name.startswith("apiary_engine_"):
                for s in fam.samples:
                    out[s.name.removeprefix("apiary_engine_")] = s.value
        return out

    # ------------------------------------------------------------------ internals

    def _schedule_anomalies(self) -> None:
        """Spread the injected anomalies over the first part of the run, one device after another."""
        o = self.options
        hives = sorted(self._fleet.sites())
        from apiary.firmware_bridge.simulator import ANOMALIES

        kinds = list(ANOMALIES)
        frames_per_device_per_s = o.rate / max(1, len(hives))
        sim_per_wall_s = frames_per_device_per_s * o.interval_s
        n = len(hives) * o.anomalies_per_device
        first = 0
        if o.early_first_anomaly and n:
            # no ramp: its first frame shows it; six frames long, so it adds little load
            self._fleet.inject("sensor_fault", hives[0], self._fleet.t + o.interval_s, 6 * o.interval_s)
            kinds.remove("sensor_fault")
            first = 1
        for k in range(first, n):
            wall_at = 5.0 + o.anomaly_window_s * k / max(1, n)
            self._fleet.inject(kinds[(k - first) % len(kinds)], hives[k % len(hives)],
                               self._fleet.t + wall_at * sim_per_wall_s)

    def _simulate(self) -> None:
        from apiary.firmware_bridge.simulator import emit

        def count(_: Any) -> None:
            self.frames_sent += 1

        emit(self._fleet.frames(), self._bridge.feed_datagram, rate=self.options.rate, stop=self._stop_sim.is_set,
             on_frame=count)

    def _wait_for_cloud(self, log_path: Path) -> tuple[str, str]:
        deadline = time.monotonic() + self.options.startup_timeout_s
        url = key = ""
        while time.monotonic() < deadline:
            text = log_path.read_text(errors="replace") if log_path.exists() else ""
            if m := re.search(r"listening on (http://\S+)", text):
                url = m.group(1)
            if m := re.search(r"API key for this process[^:]*: (\S+)", text):
                key = m.group(1)
            if url and key:
                return url, key
            if self.supervisor.failed():
                break
            time.sleep(0.3)
        raise MeshError(f"the cloud service did not start; see {log_path}")

    def _wait_for_edges(self) -> None:
        want = {(s, d) for s, d in self.devices()}
        deadline = time.monotonic() + self.options.startup_timeout_s
        while time.monotonic() < deadline:
            online = {tuple(k.split("/", 1)) for k, up in self.observer.snapshot()["nodes_online"].items() if up}
            if want <= online:
                return
            if failed := self.crashed():
                raise MeshError(f"a component exited during start-up: {failed[0]}")
            time.sleep(0.3)
        raise MeshError(f"edge agents not online after {self.options.startup_timeout_s}s: "
                        f"{sorted(want - online)}; logs in {self.supervisor.log_dir}")
