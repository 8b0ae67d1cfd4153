"""Event factories and small helpers shared by the edge tests."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from apiary.edge.model import Generation
from apiary.shared.config import MqttConfig
from apiary.shared.protocol import SensorEvent, Severity

SITE, DEVICE = "north", "hive-01"
ROOT = Path(__file__).resolve().parents[2]

NORMAL = dict(hive_temp_c=34.8, hive_humidity_pct=58.0, ambient_temp_c=21.0, hive_weight_kg=41.2, acoustic_db=55.0,
              acoustic_freq_hz=240.0, bee_traffic=1800.0, battery_v=3.95, solar_w=4.0)


def reading(seq: int, *, severity: Severity = Severity.INFO, flags: tuple[str, ...] = (), ts: float | None = None,
            site: str = SITE, device: str = DEVICE, **changes: float) -> SensorEvent:
    return SensorEvent(site=site, device=device, seq=seq, timestamp=ts if ts is not None else 1_700_000_000.0 + 60 * seq,
                       readings={**NORMAL, **changes}, severity=severity, flags=list(flags))


def question(seq: int, text: str = "Should I add a super this week?", *, want_cloud: bool = False,
             site: str = SITE, device: str = DEVICE) -> SensorEvent:
    return SensorEvent(site=site, device=device, seq=seq, timestamp=1_700_000_000.0 + 60 * seq, readings={},
                       kind="question", question=text, want_cloud=want_cloud)


# Situations with an unambiguous expected assessment (as the bridge's thresholds would flag them).
SITUATIONS: dict[str, SensorEvent] = {
    "heat_stress": reading(1, severity=Severity.CRITICAL, flags=("hive_temp_c_high", "ambient_temp_c_high"),
                           hive_temp_c=40.5, ambient_temp_c=38.0),
    "swarming": reading(2, severity=Severity.CRITICAL, flags=("hive_weight_drop", "acoustic_freq_hz_high"),
                        hive_weight_kg=38.9, acoustic_freq_hz=450.0, acoustic_db=76.0),
    "robbing": reading(3, severity=Severity.WARNING, flags=("bee_traffic_high",), bee_traffic=9000.0),
    "sensor_fault": reading(4, severity=Severity.WARNING, flags=("hive_humidity_pct_implausible",),
                            hive_humidity_pct=0.0),
    "low_battery": reading(5, severity=Severity.CRITICAL, flags=("battery_v_low",), battery_v=3.3, solar_w=0.0),
}


ANSWER = json.dumps({"explanation": "Traffic jumped.", "assessment": "robbing", "urgency": "medium",
                     "action": "Reduce the entrance"})


class RecordingModel:
    """Answers every chat with the same valid action and keeps the chats it was asked."""

    version = "recording:0"

    def __init__(self, prompt_style: str | None = None) -> None:
        if prompt_style is not None:
            self.prompt_style = prompt_style
        self.asked: list[list] = []

    def set_threads(self, threads: int) -> None:
        pass

    def generate(self, messages, *, max_tokens: int = 96) -> Generation:
        self.asked.append(list(messages))
        n = len(ANSWER.encode())  # one "token" per byte
        return Generation(text=ANSWER, token_ids=list(range(n)), logprobs=[0.0] * n, choice_logprobs=[-0.1] * n,
                          entropies=[0.1] * n, offsets=list(range(n)), prompt_tokens=10, finished=True,
                          cpu_s=0.01, wall_s=0.01)


def export_styled_ggufs(root: Path, teacher: Path) -> dict[str, Path]:
    """Tiny random-weight Llamas exported by ``apiary quantize`` (``apiary.deploy.quantize``) with the ``teacher``
    GGUF's tokenizer, so llama.cpp loads them in a moment (their answers are noise): "plain" without
    apiary.prompt_style, "short" tuned for the short prompt, "verbose" naming a style nobody knows."""
    import gguf
    import pytest

    import apiary.deploy.quantize
    from apiary.cloud.engine.loader import read_gguf_metadata
    from apiary.deploy.quantize import export_gguf
    from apiary.deploy.student import save_hf_folder, tokenizer_metadata
    from tests.deploy.conftest import tiny_model

    tokenizer_meta = tokenizer_metadata(read_gguf_metadata(gguf.GGUFReader(teacher)))
    model = tiny_model(seed=3)
    plain = save_hf_folder(model, tokenizer_meta, root / "plain")
    short = save_hf_folder(model, tokenizer_meta, root / "short", {"apiary_distill": {"prompt_style": "short"}})
    out = {"plain": export_gguf(plain, root / "plain.gguf"), "short": export_gguf(short, root / "short.gguf")}
    with pytest.MonkeyPatch.context() as mp:  # export refuses unknown styles: write one past its check
        mp.setattr(apiary.deploy.quantize, "folder_prompt_style", lambda folder: "verbose")
        out["verbose"] = export_gguf(plain, root / "verbose.gguf")
    return out


class FileServer:
    """A real threaded HTTP file server that honours Range requests, like the cloud's image route.

    ``cut_next[name] = n`` makes the next response stop after n body bytes and drop the connection (a
    flaky field link); ``hold_next[name] = (n, gate)`` sends n body bytes, then waits for the
    ``threading.Event`` gate before sending the rest (a download caught in the middle)."""

    def __init__(self) -> None:
        self.files: dict[str, Path] = {}
        self.cut_next: dict[str, int] = {}
        self.hold_next: dict[str, tuple[int, threading.Event]] = {}
        self.held = threading.Event()  # set once a held response has sent its first part
        self.requests: list[tuple[str, str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                name = self.path.lstrip("/")
                rng = self.headers.get("Range")
                server.requests.append((name, rng))
                if name not in server.files:
                    self.send_error(404)
                    return
                data = server.files[name].read_bytes()
                start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206 if rng else 200)
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                hold = server.hold_next.pop(name, None)
                if hold is not None:
                    self.wfile.write(data[start:start + hold[0]])
                    self.wfile.flush()
                    server.held.set()
                    hold[1].wait()
                    start += hold[0]
                cut = server.cut_next.pop(name, None)
                body = data[start:] if cut is None else data[start:start + cut]
                self.wfile.write(body)
                self.wfile.flush()
                if cut is not None:  # the link drops: close mid-body
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{name}"


def agent_process(config: MqttConfig, state_dir: Path, cfg_file: Path, log: Path) -> subprocess.Popen:
    """``python -m apiary.edge run`` for SITE/DEVICE as its own process (what ``apiary edge run`` starts), output in ``log``."""
    env = {**os.environ, "APIARY_LOG_FORMAT": "text", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "edge", "run", "--site", SITE, "--device", DEVICE, "--broker", config.url,
           "--state-dir", str(state_dir), "--config", str(cfg_file)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
