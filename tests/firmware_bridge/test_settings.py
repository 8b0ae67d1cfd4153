"""The bridge's settings: default node names (MQTT client ids) that two bridges on one host never share."""
from __future__ import annotations

import socket

from apiary.firmware_bridge.settings import load_settings


def test_default_names_carry_the_host_and_the_role(tmp_path) -> None:
    serial, udp = load_settings(None, role="serial"), load_settings(None, role="udp")
    assert serial.name != udp.name
    host = socket.gethostname().split(".")[0][:8]
    assert host in serial.name and serial.name.endswith("serial") and udp.name.endswith("udp")
    assert load_settings(None, role="udp", name="north").name == "north"  # an explicit name wins
    cfg = tmp_path / "apiary.toml"
    cfg.write_text('[bridge]\nname = "from-file"\n')
    assert load_settings(cfg, role="udp").name == "from-file"


def test_sites_default_alike_in_the_bridges_and_the_edge() -> None:
    """Bridges and an edge agent started without --site meet on the same site (the bridge's default_site)."""
    import re

    from typer.testing import CliRunner

    from apiary.cli import app

    default = load_settings(None).default_site
    for command in (["bridge", "udp"], ["bridge", "serial"], ["edge", "run"]):
        text = CliRunner().invoke(app, [*command, "--help"]).output
        site = " ".join(re.search(r"^\s*--site\b.*?(?=^\s*--)", text, re.M | re.S).group(0).split())
        assert default in site and "required" not in site, (command, site)
