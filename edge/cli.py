"""`apiary edge run|answer`: the device agent process, and a one-shot local answer for trying the model."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from apiary.shared.topics import DEFAULT_SITE

# Help is plain text (rich_markup_mode=None here and in `apiary`), so "[mqtt]" prints as written.
BROKER_HELP = "MQTT broker URL (mqtt://host:port); default: [mqtt] in the config, else mqtt://127.0.0.1:1883"
CONFIG_HELP = "apiary TOML config ([edge] and [mqtt] sections); also $APIARY_CONFIG"
STYLE_HELP = ("prompt style the model is asked in: auto (the GGUF's apiary.prompt_style, else examples) | examples | "
              "short; default: prompt_style in [edge], else auto")


def edge_app() -> typer.Typer:
    """The edge commands (``apiary edge …``; ``python -m apiary.edge …`` runs them directly)."""
    edge = typer.Typer(help="The edge agent: local INT4 model, escalation to the cloud, store-and-forward.",
                       no_args_is_help=True, pretty_exceptions_show_locals=False, rich_markup_mode=None)
    edge.command("run")(run)
    edge.command("answer")(answer)
    return edge


def register(app: typer.Typer) -> None:
    app.add_typer(edge_app(), name="edge")


def run(
    site: str = typer.Option(DEFAULT_SITE, "--site", help="site name (the MQTT group): the bridge's --site"),
    device: str = typer.Option(..., "--device", help="device name: the agent serves this device's events"),
    broker: Optional[str] = typer.Option(None, "--broker", help=BROKER_HELP),
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF file; default: the shipped edge image's INT4 student"),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", help="where the SQLite inbox/outbox lives"),
    prompt_style: Optional[str] = typer.Option(None, "--prompt-style", help=STYLE_HELP),
    config: Optional[Path] = typer.Option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Serve one device: answer its sensor events locally or via the cloud, and apply its signed OTA updates
    ([edge.ota] in the config), until SIGTERM/Ctrl-C."""
    import signal
    import threading

    from apiary.edge.agent import EdgeAgent
    from apiary.edge.errors import EdgeError
    from apiary.edge.settings import load
    from apiary.shared.assets import AssetError
    from apiary.shared.config import ConfigError, mqtt_settings
    from apiary.shared.logs import configure
    from apiary.shared.topics import TopicError

    configure()
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        settings = load(config, model_path=str(model) if model else None,
                        state_dir=str(state_dir) if state_dir else None, prompt_style=prompt_style)
        mqtt = mqtt_settings(config, broker)
        agent = EdgeAgent(settings, site=site, device=device, mqtt=mqtt)
        agent.run(stop)
    except (ConfigError, EdgeError, TopicError, AssetError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def answer(
    readings: str = typer.Argument(..., help='readings as JSON, e.g. \'{"hive_temp_c": 39.5, "battery_v": 3.9}\''),
    flags: str = typer.Option("", "--flags", help="comma-separated threshold flags, e.g. hive_temp_high"),
    severity: str = typer.Option("warning", "--severity", help="info | warning | critical"),
    question: Optional[str] = typer.Option(None, "--question", help="an operator question"),
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF file; default: the shipped edge image's INT4 student"),
    prompt_style: Optional[str] = typer.Option(None, "--prompt-style", help=STYLE_HELP),
    config: Optional[Path] = typer.Option(None, "--config", help=CONFIG_HELP),
) -> None:
    """Answer one situation with the local model and print the answer, confidence and policy decision."""
    import json
    import time

    from pydantic import ValidationError

    from apiary.edge.errors import EdgeError
    from apiary.edge.model import LocalModel
    from apiary.edge.responder import Responder
    from apiary.edge.settings import load
    from apiary.shared.assets import AssetError
    from apiary.shared.config import ConfigError
    from apiary.shared.protocol import SensorEvent

    try:
        values = json.loads(readings)
        event = SensorEvent(site="cli", device="cli", seq=0, timestamp=time.time(), readings=values,
                            severity=severity, flags=[f for f in flags.split(",") if f],
                            kind="question" if question else "reading", question=question)
        settings = load(config, model_path=str(model) if model else None, prompt_style=prompt_style)
        responder = Responder(settings, LocalModel.from_settings(settings))
    except (json.JSONDecodeError, ValidationError, ConfigError, EdgeError, AssetError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    out = responder.respond(event, link_up=True)
    doc = {"route": out.route, "answer": out.answer.model_dump(mode="json") if out.answer else None,
           "escalate": out.decision.escalate if out.decision else False,
           "reasons": list(out.decision.reasons) if out.decision else [],
           "prompt_style": responder.model.prompt_style, "prompt_style_source": responder.model.prompt_style_source,
           "confidence": out.confidence.quantiles if out.confidence else None,
           "tokens_per_s": round(out.generation.tokens_per_s, 1) if out.generation else None}
    typer.echo(json.dumps(doc, indent=2))
