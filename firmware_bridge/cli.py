"""`apiary bridge serial|udp|replay …` and `apiary simulate run|situations`."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from apiary.shared.topics import DEFAULT_SITE

BROKER_HELP = "MQTT broker URL (mqtt://host:port) [from [mqtt] in the config, else mqtt://127.0.0.1:1883]"
CONFIG_HELP = "apiary TOML config ([bridge] and [mqtt] sections); also $APIARY_CONFIG"
NAME_HELP = "bridge node name and MQTT client id [from [bridge] in the config, else bridge-<host>-{role}]"
DEFAULT_ANOMALY_AFTER_S = 20.0  # a newcomer watching `simulate run` sees the first anomaly within the minute
SITE_HELP = (f"site of the devices not mapped in [bridge.sites], the edge agent's --site [from [bridge] in the "
             f"config, else {DEFAULT_SITE}]")


def register(app: typer.Typer) -> None:
    bridge = typer.Typer(help="Sensor frames (serial, UDP, capture file) -> validated MQTT sensor events.",
                         no_args_is_help=True)
    bridge.command("serial")(serial)
    bridge.command("udp")(udp)
    bridge.command("replay")(replay)
    app.add_typer(bridge, name="bridge")
    simulate = typer.Typer(help="Virtual hives emitting real frames, with labelled anomalies.", no_args_is_help=True)
    simulate.command("run")(simulate_run)
    simulate.command("situations")(simulate_situations)
    app.add_typer(simulate, name="simulate")


# -- bridge ---------------------------------------------------------------------------------------

def _start_bridge(config: Optional[Path], broker: Optional[str], name: Optional[str], site: Optional[str],
                  role: str, truth_lookup: Any = None) -> Any:
    from apiary.firmware_bridge.bridge import connect
    from apiary.firmware_bridge.settings import load_settings
    from apiary.shared.config import ConfigError, mqtt_settings
    from apiary.shared.logs import configure
    from apiary.shared.transport import TransportError

    configure()
    try:
        settings = load_settings(config, role=role, name=name, default_site=site)
        mqtt = mqtt_settings(config, broker)
        return connect(settings, mqtt, truth_lookup=truth_lookup)
    except (ConfigError, TransportError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _sites(settings: Any) -> str:
    """Where events go, said at start: an edge agent on another site would never hear a thing."""
    mapped = f" ({len(settings.sites)} devices mapped in [bridge.sites])" if settings.sites else ""
    return f"events on site {settings.default_site}{mapped}"


def _run_until_signal(bridge: Any, target: Any, *args: Any) -> None:
    """Run a source loop in a thread until Ctrl-C/SIGTERM (or it fails), then drain and stop."""
    import json
    import signal
    import threading

    from apiary.firmware_bridge.errors import BridgeError

    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            target(bridge, *args, stop)
        except BridgeError as e:
            failure.append(e)
        finally:
            stop.set()

    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    reader = threading.Thread(target=run, name="bridge-reader", daemon=True)
    reader.start()
    try:
        stop.wait()
        reader.join(5)
        bridge.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    typer.echo(json.dumps(bridge.counters()))
    if failure:
        typer.echo(f"error: {failure[0]}", err=True)
        raise typer.Exit(2)


def serial(
    port: str = typer.Argument(..., help="serial device, e.g. /dev/ttyUSB0 or a pty slave /dev/pts/N"),
    baud: int = typer.Option(115200, help="baud rate"),
    broker: Optional[str] = typer.Option(None, help=BROKER_HELP),
    name: Optional[str] = typer.Option(None, help=NAME_HELP.format(role="serial")),
    site: Optional[str] = typer.Option(None, help=SITE_HELP),
    config: Optional[Path] = typer.Option(None, help=CONFIG_HELP),
) -> None:
    """Bridge a serial line (firmware writing frames over UART) until Ctrl-C."""
    from apiary.firmware_bridge.errors import BridgeError
    from apiary.firmware_bridge.sources import open_serial, run_serial

    try:
        line = open_serial(port, baud)
    except BridgeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    bridge = _start_bridge(config, broker, name, site, "serial")
    typer.echo(f"bridge {bridge.settings.name}: reading {port} at {baud} baud; {_sites(bridge.settings)}")
    _run_until_signal(bridge, lambda b, stop: run_serial(b, line, stop))


def udp(
    host: str = typer.Option("0.0.0.0", help="address to listen on"),
    port: int = typer.Option(47474, help="UDP port (0 = any free one, printed)"),
    broker: Optional[str] = typer.Option(None, help=BROKER_HELP),
    name: Optional[str] = typer.Option(None, help=NAME_HELP.format(role="udp")),
    site: Optional[str] = typer.Option(None, help=SITE_HELP),
    config: Optional[Path] = typer.Option(None, help=CONFIG_HELP),
) -> None:
    """Bridge UDP datagrams (each one or more whole frames, e.g. from a LoRa/Wi-Fi gateway) until Ctrl-C."""
    from apiary.firmware_bridge.errors import BridgeError
    from apiary.firmware_bridge.sources import open_udp, run_udp

    try:
        sock = open_udp(host, port)
    except BridgeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    bridge = _start_bridge(config, broker, name, site, "udp")
    typer.echo(f"bridge {bridge.settings.name}: listening on udp://{host}:{sock.getsockname()[1]}; "
               f"{_sites(bridge.settings)}")
    _run_until_signal(bridge, lambda b, stop: run_udp(b, sock, stop))


def replay(
    capture: Path = typer.Argument(..., help="capture file: a raw byte stream as recorded from a serial line"),
    bytes_per_s: float = typer.Option(0.0, help="pace the replay (0 = as fast as possible)"),
    broker: Optional[str] = typer.Option(None, help=BROKER_HELP),
    name: Optional[str] = typer.Option(None, help=NAME_HELP.format(role="replay")),
    site: Optional[str] = typer.Option(None, help=SITE_HELP),
    config: Optional[Path] = typer.Option(None, help=CONFIG_HELP),
) -> None:
    """Publish every frame of a capture file, print the counters, exit (non-zero if events were lost)."""
    import json

    from apiary.firmware_bridge.errors import BridgeError
    from apiary.firmware_bridge.sources import run_replay

    if not capture.is_file():
        typer.echo(f"error: capture file not found: {capture}", err=True)
        raise typer.Exit(2)
    bridge = _start_bridge(config, broker, name, site, "replay")
    try:
        run_replay(bridge, capture, bytes_per_s=bytes_per_s)
    except BridgeError as e:
        bridge.stop()
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    drained = bridge.stop(drain_timeout=60.0)
    counters = bridge.counters()
    typer.echo(json.dumps(counters))
    if not drained or counters["dropped"]:
        typer.echo(f"error: {counters['buffered']} events not published, {counters['dropped']} dropped", err=True)
        raise typer.Exit(1)


# -- simulate -------------------------------------------------------------------------------------

def _parse_inject(spec: str) -> tuple[str, int, float]:
    """``KIND:DEVICE@HOURS`` (hours after the simulation start) -> (kind, device id, hours)."""
    from apiary.firmware_bridge.errors import BridgeError

    try:
        kind, rest = spec.split(":", 1)
        device, hours = rest.split("@", 1)
        return kind.strip(), int(device), float(hours)
    except ValueError:
        raise BridgeError(f"--inject {spec!r}: expected KIND:DEVICE@HOURS, e.g. swarming:3@12.5") from None


def simulate_run(
    sites: int = typer.Option(2, help="number of sites"),
    devices: int = typer.Option(4, help="hives per site (device ids run from 1)"),
    seed: int = typer.Option(0, help="random seed (same seed, same fleet and readings)"),
    rate: float = typer.Option(10.0, help="frames per second, all devices together (0 = as fast as possible)"),
    interval: float = typer.Option(300.0, help="sim seconds between two frames of one device"),
    count: Optional[int] = typer.Option(None, help="stop after this many frames"),
    duration: Optional[float] = typer.Option(None, help="stop after this many wall seconds"),
    anomalies: int = typer.Option(0, help="inject this many random labelled anomalies"),
    anomaly_after: float = typer.Option(DEFAULT_ANOMALY_AFTER_S, min=0, help="wall seconds (at --rate) until the "
                                        "first of the --anomalies starts; the others follow at their kinds' usual "
                                        "hours (with --rate 0: at the first frame)"),
    inject: list[str] = typer.Option([], help="KIND:DEVICE@HOURS after start, e.g. swarming:3@12.5 (repeatable)"),
    noise: float = typer.Option(0.0, help="fraction of frames damaged or preceded by garbage (tests resync)"),
    udp: Optional[str] = typer.Option(None, help="send to a bridge at HOST:PORT over UDP"),
    pty: bool = typer.Option(False, help="create a pseudo-terminal and write frames to it (bridge reads the slave)"),
    serial: Optional[str] = typer.Option(None, help="write frames to this serial device"),
    out: Optional[Path] = typer.Option(None, help="write frames to a capture file (for `apiary bridge replay`)"),
    broker: Optional[str] = typer.Option(None, help="run a bridge in-process publishing to this broker; its events "
                                                    "carry the ground-truth label (simulation/evaluation only)"),
    labels: Optional[Path] = typer.Option(None, help="write each frame's ground truth as JSON lines"),
    bridge_config: Optional[Path] = typer.Option(None, help="write a [bridge] TOML mapping this fleet's devices "
                                                            "to their sites"),
) -> None:
    """Run a fleet of virtual hives and emit their frames to one sink."""
    import json
    import signal
    import threading
    import time

    from apiary.firmware_bridge.errors import BridgeError
    from apiary.firmware_bridge.simulator import DAY, HOUR, Fleet, PtySink, UdpSink, emit

    sinks = [s for s in (udp, pty or None, serial, out, broker) if s]
    if len(sinks) != 1:
        typer.echo("error: choose exactly one of --udp, --pty, --serial, --out, --broker", err=True)
        raise typer.Exit(2)
    try:
        fleet = Fleet(sites, devices, seed=seed, interval_s=interval, boot=int(time.time()))
        for spec in inject:
            kind, device, hours = _parse_inject(spec)
            fleet.inject(kind, device, fleet.t + hours * HOUR)
        total = count if count is not None else (int(duration * rate) if duration and rate else None)
        horizon = (total / len(fleet.hives) * interval) if total else 7 * DAY
        sim_per_wall_s = rate / len(fleet.hives) * interval  # sim seconds that pass in one wall second
        placed = fleet.inject_random(anomalies, horizon, first_at_s=anomaly_after * sim_per_wall_s)
        if len(placed) < anomalies:
            typer.echo(f"warning: only {len(placed)} of {anomalies} anomalies fit in the {horizon / HOUR:.1f} h "
                       "of sim time this run covers (raise --count/--duration or --interval)", err=True)
    except BridgeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if bridge_config:
        lines = ["[bridge]", "[bridge.sites]"] + [f"{dev} = \"{site}\"" for dev, site in fleet.sites().items()]
        bridge_config.write_text("\n".join(lines) + "\n")
    for a in fleet.anomalies:
        wall = f" (~{(a.start - fleet.t) / sim_per_wall_s:.1f} s in)" if sim_per_wall_s else ""
        typer.echo(f"anomaly {a.kind} on device {a.device_id} at +{(a.start - fleet.t) / HOUR:.2f} h{wall} "
                   f"for {a.duration_s / HOUR:.2f} h{f' ({a.mode})' if a.mode else ''}", err=True)

    closers: list[Any] = []
    bridge = None
    stop = threading.Event()
    try:
        if udp:
            host, _, port = udp.rpartition(":")
            sink = UdpSink(host or "127.0.0.1", int(port))
            closers.append(sink.close)
        elif pty:
            sink = PtySink(stop=lambda: stop.is_set())
            closers.append(sink.close)
            typer.echo(f"pty: {sink.path}  (start `apiary bridge serial {sink.path}`; frames flow once it reads)")
        elif serial:
            import serial as pyserial

            line = pyserial.Serial(serial, baudrate=115200)
            sink = line.write
            closers.append(line.close)
        elif out:
            capture = open(out, "wb")
            sink = capture.write
            closers.append(capture.close)
        else:
            from apiary.firmware_bridge.bridge import connect
            from apiary.firmware_bridge.settings import BridgeSettings
            from apiary.shared.config import MqttConfig
            from apiary.shared.logs import configure

            from apiary.firmware_bridge.settings import default_name

            configure()
            # Each hive on its own site (site-0, site-1, …), as the demo maps them; the client id is this host's
            # (bridge-<host>-sim), so it never takes a bridge's session.
            bridge = connect(BridgeSettings(name=default_name("sim"), sites=fleet.sites()),
                             MqttConfig.from_url(broker), truth_lookup=fleet.truth)
            typer.echo(f"events on {fleet.describe_sites(BridgeSettings().node_of)}", err=True)
            sink = bridge.feed_datagram
    except Exception as e:  # pyserial, sockets, files, broker: all end here with one clear message
        for close in closers:
            close()
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None

    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    label_file = open(labels, "w") if labels else None

    def on_frame(f: Any) -> None:
        if label_file:
            label_file.write(json.dumps({"device_id": f.device_id, "site": f.site, "seq": f.seq,
                                         "timestamp": f.timestamp, "label": f.label}) + "\n")

    try:
        stats = emit(fleet.frames(), sink, rate=rate, count=count, duration_s=duration, noise=noise, seed=seed,
                     on_frame=on_frame, stop=stop.is_set)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if label_file:
            label_file.close()
        if bridge is not None:
            bridge.stop()
        for close in closers:
            close()
    typer.echo(json.dumps({"frames": stats.frames, "bytes": stats.bytes, "corrupted": stats.corrupted,
                           "garbage": stats.garbage, "labels": stats.labels}))


def simulate_situations(
    n: int = typer.Option(60, help="number of situations (labels balanced over the assessments)"),
    seed: int = typer.Option(0, help="random seed"),
    context: int = typer.Option(6, help="preceding events of the same device to include"),
    out: Optional[Path] = typer.Option(None, help="JSON lines file [stdout]"),
) -> None:
    """Labelled evaluation situations (event, its context, the truth) as JSON lines."""
    import json
    import sys

    from apiary.firmware_bridge.errors import BridgeError
    from apiary.firmware_bridge.simulator import labelled_situations

    try:
        situations = labelled_situations(n, seed, context=context)
    except BridgeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    f = open(out, "w") if out else sys.stdout
    try:
        for s in situations:
            f.write(json.dumps({"label": s.label, "event": s.event.model_dump(mode="json"),
                                "context": [c.model_dump(mode="json") for c in s.context]}) + "\n")
    finally:
        if out:
            f.close()
