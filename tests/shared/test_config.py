from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from apiary.shared.config import ConfigError, MqttConfig, load_section


class Edge(BaseModel):
    max_tokens: int = 64
    critical_kinds: list[str] = []
    nested: dict[str, float] = {}


def test_file_then_env_then_explicit(tmp_path: Path) -> None:
    cfg = tmp_path / "apiary.toml"
    cfg.write_text('[mqtt]\nhost = "broker.local"\nport = 1884\n[edge]\nmax_tokens = 32\n')
    env = {"APIARY__MQTT__PORT": "1990", "APIARY__EDGE__NESTED__WATTS": "2.5", "OTHER": "x"}
    mqtt = load_section("mqtt", MqttConfig, cfg, environ=env)
    assert (mqtt.host, mqtt.port) == ("broker.local", 1990)
    edge = load_section("edge", Edge, cfg, environ=env, max_tokens=None)
    assert edge.max_tokens == 32 and edge.nested == {"watts": 2.5}
    assert load_section("edge", Edge, cfg, environ={}, max_tokens=16).max_tokens == 16


def test_errors_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[mqtt\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_section("mqtt", MqttConfig, bad, environ={})
    with pytest.raises(ConfigError, match="not found"):
        load_section("mqtt", MqttConfig, tmp_path / "missing.toml", environ={})
    with pytest.raises(ConfigError, match=r"invalid \[mqtt\]"):
        load_section("mqtt", MqttConfig, None, environ={"APIARY__MQTT__PORT": "70000"})


def test_broker_urls() -> None:
    c = MqttConfig.from_url("mqtts://dev:secret@example.org")
    assert (c.host, c.port, c.tls, c.username, c.password) == ("example.org", 8883, True, "dev", "secret")
    assert MqttConfig.from_url("mqtt://127.0.0.1:1999").url == "mqtt://127.0.0.1:1999"
    with pytest.raises(ConfigError):
        MqttConfig.from_url("http://x")


def test_any_setting_name_can_be_passed_explicitly() -> None:
    class Cloud(BaseModel):
        model: str = "smollm2-135m-q4"
        path: str = "."

    got = load_section("cloud", Cloud, None, environ={}, model="/models/x.gguf", path="/srv")
    assert (got.model, got.path) == ("/models/x.gguf", "/srv")
