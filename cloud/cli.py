"""`apiary cloud …`: run the cloud service and manage its API keys; `apiary fleet …`: the fleet's data."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    cloud = typer.Typer(help="The cloud tier: engine + MQTT escalation worker + REST API.", no_args_is_help=True)
    keys = typer.Typer(help="API keys (stored hashed, scoped: inference | operator).", no_args_is_help=True)
    cloud.command("serve")(serve)
    keys.command("create")(create_key)
    cloud.add_typer(keys, name="keys")
    app.add_typer(cloud, name="cloud")
    database = typer.Typer(help="The cloud store's database schema (Alembic migrations).", no_args_is_help=True)
    database.command("upgrade")(db_upgrade)
    cloud.add_typer(database, name="db")
    fleet = typer.Typer(help="The fleet's recorded data in the cloud store.", no_args_is_help=True)
    fleet.command("export-labels")(export_labels)
    app.add_typer(fleet, name="fleet")


def serve(
    broker: Optional[str] = typer.Option(None, help="MQTT broker URL (mqtt://host:port); omit for REST only"),
    host: Optional[str] = typer.Option(None, help="HTTP bind address [127.0.0.1]"),
    port: Optional[int] = typer.Option(None, help="HTTP port, 0 = any free one [8000]"),
    model: Optional[str] = typer.Option(None, help="model path (GGUF / HF folder) or registry name [smollm2-135m-q4]"),
    adapter: Optional[str] = typer.Option(None, help="LoRA adapter merged into the model at load (apiary finetune): "
                                                     "a folder, a shipped name, none, or auto [auto: the shipped "
                                                     "teacher when the model is its base]"),
    db: Optional[str] = typer.Option(None, help="database: postgresql://… , sqlite:///… or a SQLite file path "
                                                "[.apiary/cloud.db]"),
    images: Optional[str] = typer.Option(None, help="directory of OTA images served at /v1/images [.apiary/images]"),
    api_key_file: Optional[str] = typer.Option(None, help="hashed API keys, JSON lines [.apiary/cloud-keys.jsonl]"),
    dtype: Optional[str] = typer.Option(None, help="auto | float32 | bfloat16"),
    weights: Optional[str] = typer.Option(None, help="decoder weights: auto | dtype | int8 (W8A8, CPU) | bf16 (a float32 engine's weights held in bf16, CPU); "
                                 "auto: bf16 where dtype auto is float32 on a CPU (no native bf16) [auto]"),
    head: Optional[str] = typer.Option(None, help="LM head: auto (bf16 and int8 engines on CPU rank in int8, the "
                                                  "logits that can win exact) | dtype [auto]"),
    kv_cache_dtype: Optional[str] = typer.Option(None, help="KV cache rows: auto (bf16 where the weights are held "
                                                            "in bf16 for float32 rows, else = dtype) | dtype | bf16 "
                                                            "(CPU under float32) | int8 (per-token scales, CPU: ~2x the "
                                                            "tokens of bf16) [auto]"),
    worker_id: Optional[str] = typer.Option(None, help="this process's MQTT client id / worker name"),
    speculative: Optional[str] = typer.Option(None, help="speculative decoding: off | ngram | draft [off]"),
    draft_model: Optional[str] = typer.Option(None, help="draft checkpoint for --speculative draft "
                                                         "(e.g. a distilled student folder)"),
    tls_cert: Optional[str] = typer.Option(None, help="serve HTTPS with this certificate (PEM; apiary pki issue "
                                                      "HOST --server)"),
    tls_key: Optional[str] = typer.Option(None, help="the certificate's private key (PEM)"),
    drain_timeout: float = typer.Option(30.0, min=0, help="on SIGTERM or Ctrl-C, answer /ready with 503 and let "
                                                          "in-flight requests finish for up to this many seconds "
                                                          "before exiting (a second signal exits at once)"),
    config: Optional[Path] = typer.Option(None, help="apiary TOML config ([cloud] section; the broker's TLS files "
                                                     "from [mqtt]); also $APIARY_CONFIG"),
) -> None:
    """Run the engine, the MQTT escalation worker and the REST API in one process until SIGTERM or Ctrl-C, then
    drain: /ready answers 503, new requests are refused with 503, in-flight ones finish (--drain-timeout)."""
    import signal
    import threading

    from apiary.cloud.errors import CloudError
    from apiary.cloud.service import CloudService
    from apiary.cloud.settings import load_settings
    from apiary.shared.logs import configure

    configure()
    try:
        settings = load_settings(config, broker=broker, host=host, port=port, model=model, adapter=adapter, db=db,
                                 images=images,
                                 api_key_file=api_key_file, dtype=dtype, weights=weights, head=head,
                                 kv_cache_dtype=kv_cache_dtype, worker_id=worker_id,
                                 speculative=speculative, draft_model=draft_model, tls_cert=tls_cert,
                                 tls_key=tls_key)
        service = CloudService(settings)
        info = service.start()
    except CloudError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"cloud service listening on {info.url} (model {info.model}, broker {info.broker or 'none'})")
    if info.api_key:
        typer.echo(f"API key for this process (inference + operator scopes): {info.api_key}")
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(*_: object) -> None:
        if stop.is_set():
            hurry.set()  # a second signal: stop draining
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        while not stop.is_set() and service.running:
            stop.wait(0.5)
        if stop.is_set() and service.running:
            typer.echo(f"draining: finishing in-flight requests for up to {drain_timeout:g} s "
                       "(signal again to stop now)")
            if not service.drain(drain_timeout, cancel=hurry):
                typer.echo("drain cut short: requests still in flight are cancelled", err=True)
    finally:
        service.stop()
        typer.echo("cloud service stopped")


def create_key(
    scope: list[str] = typer.Option(..., "--scope", help="inference | operator (repeat for both)"),
    name: str = typer.Option("", help="a label for the key"),
    api_key_file: Optional[str] = typer.Option(None, help="key file [from config, else .apiary/cloud-keys.jsonl]"),
    config: Optional[Path] = typer.Option(None, help="apiary TOML config ([cloud] section)"),
) -> None:
    """Create an API key; its hash goes to the key file, the key itself is printed once."""
    from apiary.cloud.auth import KeyRing
    from apiary.cloud.errors import CloudError
    from apiary.cloud.settings import load_settings

    try:
        settings = load_settings(config, api_key_file=api_key_file)
        if not settings.api_key_file:
            raise CloudError("no key file configured: pass --api-key-file")
        key = KeyRing(settings.api_key_file).create(scope, name=name)
    except CloudError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(key)
    typer.echo(f"(scopes: {', '.join(sorted(set(scope)))}; stored hashed in {settings.api_key_file})", err=True)


def export_labels(
    out: Path = typer.Option(..., help="JSON-lines file to write (atomically: temporary file, then rename)"),
    db: Optional[str] = typer.Option(None, help="the cloud's database: URL or SQLite file [from config, else "
                                                ".apiary/cloud.db]"),
    since: Optional[str] = typer.Option(None, help="only labels recorded at or after this time: unix seconds or "
                                                   "ISO 8601 (UTC unless an offset is given)"),
    context: int = typer.Option(6, min=0, help="earlier events of the same device to include as context"),
    config: Optional[Path] = typer.Option(None, help="apiary TOML config ([cloud] section)"),
) -> None:
    """Operators' labels as training data: one line per labelled event, {id, label, event, context}
    (the benchmark's eval-set rows) plus note, labelled_by and labelled_at."""
    from apiary.cloud.errors import CloudError
    from apiary.cloud.labels import export_labels as export, parse_since
    from apiary.cloud.settings import load_settings
    from apiary.cloud.db.engine import sqlite_file
    from apiary.cloud.store import open_store

    try:
        settings = load_settings(config, db=db)
        path = sqlite_file(settings.db)
        if path is not None and not path.is_file():
            raise CloudError(f"no database at {settings.db}")
        since_ts = parse_since(since) if since is not None else None
        store = open_store(settings.db)
        try:
            n = export(store, out, since=since_ts, context=context)
        finally:
            store.close()
    except CloudError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {n} labelled events to {out}")


def db_upgrade(
    db: Optional[str] = typer.Option(None, help="database URL (postgresql://…, sqlite:///…) or SQLite file "
                                                "[from config, else .apiary/cloud.db]"),
    config: Optional[Path] = typer.Option(None, help="apiary TOML config ([cloud] section); also $APIARY_CONFIG"),
) -> None:
    """Migrate the store's schema to the newest revision this version knows (run once per shared PostgreSQL
    before starting replicas of a new version; SQLite files are also upgraded at start). A SQLite file made
    before schema versions existed is adopted when its tables match."""
    from apiary.cloud.db import migrate
    from apiary.cloud.db.engine import redact
    from apiary.cloud.errors import CloudError
    from apiary.cloud.settings import load_settings

    try:
        settings = load_settings(config, db=db)
        before, after = migrate.upgrade(settings.db)
    except CloudError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    where = redact(settings.db)
    typer.echo(f"{where}: already at revision {after}" if before == after
               else f"{where}: upgraded from revision {before or 'none'} to {after}")
