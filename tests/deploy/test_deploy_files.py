"""The fleet deployment files (deploy/compose.yaml, deploy/docker, deploy/systemd, deploy/prometheus, deploy/grafana),
checked without a container engine: what they reference exists, the units pass systemd's own verifier, the
dashboard asks only for series the service exports, the edge image's dependency list is enough for the edge."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))


def load_yaml(path: Path):
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed: the compose and Prometheus files cannot be "
                                              "parsed here")
    return yaml.safe_load(path.read_text())


def compose() -> dict:
    return load_yaml(DEPLOY / "compose.yaml")


def cloud_services(doc: dict) -> dict[str, dict]:
    return {name: s for name, s in doc["services"].items() if name.startswith("cloud-")}


# ---------------------------------------------------------------------------- compose


def test_compose_has_the_fleet_and_references_only_files_that_exist():
    doc = compose()
    services = doc["services"]
    assert {"mosquitto", "postgres", "prometheus", "grafana"} <= set(services)
    clouds = cloud_services(doc)
    assert len(clouds) >= 2
    referenced = []
    for name, service in services.items():
        build = service.get("build")
        if build:
            context = (DEPLOY / build["context"]).resolve()
            assert context.is_dir(), (name, context)
            dockerfile = context / build["dockerfile"]
            assert dockerfile.is_file(), (name, dockerfile)
            referenced.append(dockerfile)
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith((".", "/")):  # a bind mount (else a named volume, declared below)
                path = (DEPLOY / source).resolve()
                assert path.exists(), (name, volume)
                referenced.append(path)
            else:
                assert source in doc["volumes"], (name, source)
        for env_file in service.get("env_file", []):
            assert (DEPLOY / env_file).is_file(), (name, env_file)
    assert DEPLOY / "docker" / "cloud-cpu.Dockerfile" in referenced
    migrate = services["db-migrate"]
    assert migrate["command"] == ["cloud", "db", "upgrade"] and migrate["image"] == services["cloud-1"]["image"]
    assert migrate["environment"]["APIARY__CLOUD__DB"] == services["cloud-1"]["environment"]["APIARY__CLOUD__DB"]
    assert (DEPLOY / "grafana" / "apiary.json").resolve() in referenced


def test_compose_replicas_each_have_their_worker_id_port_and_grace_period():
    import inspect

    from apiary.cloud.cli import serve

    drain_timeout = inspect.signature(serve).parameters["drain_timeout"].default.default
    clouds = cloud_services(compose())
    worker_ids, host_ports = [], []
    for name, service in clouds.items():
        command = service["command"]
        worker_ids.append(command[command.index("--worker-id") + 1])
        assert "--broker" in command and command[command.index("--broker") + 1] == "mqtt://mosquitto:1883"
        host_ports.append(service["ports"][0].split(":")[0])
        assert service["environment"]["APIARY__CLOUD__DB"].startswith("postgresql://")  # one shared database
        assert service["depends_on"]["db-migrate"]["condition"] == "service_completed_successfully"
        grace = service["stop_grace_period"]
        assert grace.endswith("s") and float(grace[:-1]) > drain_timeout  # the drain ends before a SIGKILL
    assert worker_ids == list(clouds)  # the client id is the service's name: unique, stable across restarts
    assert len(set(host_ports)) == len(host_ports)


def test_prometheus_scrapes_every_replica_and_only_them():
    prometheus = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    targets = [t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert sorted(targets) == sorted(f"{name}:8000" for name in cloud_services(compose()))


def test_the_broker_config_is_the_shipped_template_rendered():
    """deploy/docker/mosquitto.conf carries the shipped template's settings, filled for the container."""
    from apiary.shared.brokers import MosquittoBroker

    broker = MosquittoBroker(port=1883, host="0.0.0.0", data_dir="/mosquitto/data", variables={"user": "mosquitto"})

    def settings(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]

    assert settings((DEPLOY / "docker" / "mosquitto.conf").read_text()) == settings(broker.render())


# ---------------------------------------------------------------------------- Dockerfiles


def copy_sources(dockerfile: Path) -> list[str]:
    """The build-context sources of every COPY (not COPY --from, which copies from another stage)."""
    text = dockerfile.read_text().replace("\\\n", " ")
    sources = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True) if line.strip() else []
        if not words or words[0].upper() != "COPY":
            continue
        args = words[1:]
        if any(a.startswith("--from") for a in args):
            continue
        args = [a for a in args if not a.startswith("--")]
        sources.extend(args[:-1])
    return sources


def test_there_are_cloud_cpu_cuda_and_edge_dockerfiles():
    names = {p.name for p in DOCKERFILES}
    assert {"cloud-cpu.Dockerfile", "cloud-cuda.Dockerfile", "edge.Dockerfile"} <= names
    assert "nvidia/cuda" in (DEPLOY / "docker" / "cloud-cuda.Dockerfile").read_text()
    edge = (DEPLOY / "docker" / "edge.Dockerfile").read_text()
    assert "linux/arm64,linux/amd64" in edge and "TARGETARCH" in edge
    assert "cloud/" not in copy_sources(DEPLOY / "docker" / "edge.Dockerfile")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copy_source_exists_in_the_build_context(dockerfile: Path):
    sources = copy_sources(dockerfile)
    assert sources, f"{dockerfile.name} copies nothing from the context"
    for source in sources:
        assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: not in the repository"
        assert not (ROOT / source).is_symlink()


def test_copy_source_parser_sees_what_it_should():
    """The check above is only as good as its parser: it finds context sources and skips stage copies."""
    sources = copy_sources(DEPLOY / "docker" / "cloud-cpu.Dockerfile")
    assert "cloud/" in sources and "pyproject.toml" in sources and "/opt/apiary" not in sources


def dist_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def installed_extras(dockerfile: Path) -> set[str]:
    """The extras the Dockerfile's ``pip install -e '.[...]'`` names."""
    found = re.findall(r"pip install -e '\.\[([a-z,]+)\]'", dockerfile.read_text())
    assert found, f"{dockerfile.name} does not install the package with its extras"
    return {extra for group in found for extra in group.split(",")}


def test_each_image_installs_only_its_rooms_extras():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    assert installed_extras(DEPLOY / "docker" / "edge.Dockerfile") == {"edge"}
    assert installed_extras(DEPLOY / "docker" / "cloud-cpu.Dockerfile") == {"cloud"}
    assert installed_extras(DEPLOY / "docker" / "cloud-cuda.Dockerfile") == {"cloud", "gpu"}
    for dockerfile in DOCKERFILES:
        for extra in installed_extras(dockerfile):
            assert extra in extras, f"{dockerfile.name} installs [{extra}], which pyproject.toml does not define"


def test_the_edge_extra_is_enough_for_the_edge_and_the_bridge():
    """Every edge, bridge and shared module imports with only the base dependencies and [edge] allowed (torch,
    fastapi, prometheus_client, ... refused), and `apiary edge run` / `apiary bridge udp|serial` answer --help:
    the edge image (and a device's venv) needs nothing more."""
    import tomllib
    from importlib.metadata import packages_distributions

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    assert "edge" in extras, "pyproject.toml has no [edge] extra, which the edge image installs"
    allowed = {dist_name(r) for r in project["dependencies"] + extras["edge"]}
    others = {dist_name(r) for name, reqs in extras.items() if name not in ("dev", "bench") for r in reqs
              if not r.startswith("apiary-mesh")}
    cloud_only = others - allowed
    assert {"torch", "fastapi", "prometheus-client"} <= cloud_only and "llama-cpp-python" in allowed
    blocked = sorted({module for module, dists in packages_distributions().items()
                      if {d.lower().replace("_", "-") for d in dists} & cloud_only})
    assert "torch" in blocked and "fastapi" in blocked
    script = f"""
import importlib, pkgutil, sys
BLOCKED = {blocked!r}
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not in the edge image")
sys.meta_path.insert(0, Refuse())
for package in ("apiary.shared", "apiary.edge", "apiary.firmware_bridge"):
    pkg = importlib.import_module(package)
    for info in pkgutil.walk_packages(pkg.__path__, package + "."):
        importlib.import_module(info.name)
from typer.testing import CliRunner
from apiary.cli import app
for args in (["edge", "run", "--help"], ["bridge", "udp", "--help"], ["bridge", "serial", "--help"]):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (args, result.output)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# ---------------------------------------------------------------------------- systemd


def test_units_restart_on_failure_and_keep_state_on_persistent_storage():
    assert {p.name for p in UNITS} == {"apiary-edge@.service", "apiary-bridge-udp.service",
                                       "apiary-bridge-serial@.service"}
    for unit in UNITS:
        text = unit.read_text()
        assert re.search(r"^Restart=on-failure$", text, re.M), unit.name
        assert re.search(r"^StateDirectory=apiary/", text, re.M), unit.name
        assert re.search(r"^RequiresMountsFor=/var/lib/apiary$", text, re.M), unit.name
        assert re.search(r"^ExecStart=/opt/apiary/venv/bin/apiary ", text, re.M), unit.name
    edge = (DEPLOY / "systemd" / "apiary-edge@.service").read_text()
    assert "--state-dir /var/lib/apiary/edge-%i" in edge and "StateDirectory=apiary/edge-%i" in edge


def test_units_pass_systemd_analyze_verify(tmp_path):
    """systemd's own checker, on the units as shipped, in a root where the command they run is installed (the
    system's own units copied in, so what they depend on resolves)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    system = Path("/usr/lib/systemd/system")
    if not (system / "multi-user.target").exists():
        pytest.skip(f"no systemd units in {system} to verify against")
    shutil.copytree(system, tmp_path / "usr/lib/systemd/system", symlinks=True)
    units = tmp_path / "etc/systemd/system"
    units.mkdir(parents=True)
    for unit in UNITS:
        shutil.copy(unit, units / unit.name)
    apiary = tmp_path / "opt/apiary/venv/bin/apiary"
    apiary.parent.mkdir(parents=True)
    apiary.write_text("#!/bin/sh\n")
    apiary.chmod(0o755)
    names = [u.name.replace("@.", "@hive-0001.") if "edge" in u.name else u.name.replace("@.", "@ttyUSB0.")
             for u in UNITS]
    done = subprocess.run(["systemd-analyze", "verify", f"--root={tmp_path}", *names], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done.stdout + done.stderr

    # and the check can fail: a misspelt setting in a copy is reported
    broken = units / "apiary-bridge-udp.service"
    broken.write_text(broken.read_text().replace("Restart=on-failure", "Restart=sometimes"))
    done = subprocess.run(["systemd-analyze", "verify", f"--root={tmp_path}", "apiary-bridge-udp.service"],
                          capture_output=True, text=True, timeout=60)
    assert "sometimes" in done.stdout + done.stderr


# ---------------------------------------------------------------------------- Grafana


def exported_names() -> set[str]:
    """Every series name /metrics can carry: a Metrics registry with engine values (speculation on), a finished
    request, the fleet and each labelled family's samples."""
    from prometheus_client.parser import text_string_to_metric_families

    from apiary.cloud.metrics import FleetCollector, Metrics
    from tests.cloud.test_metrics import ENGINE_VALUES

    m = Metrics()
    m.watch_engine(lambda: dict(ENGINE_VALUES), "m")
    m.request_lengths(2048)
    m.registry.register(FleetCollector(lambda: [{"site": "s", "device": "d", "role": "edge", "online": True,
                                                 "battery_soc": 0.5, "last_ota": {"phase": "committed"}}]))
    names = set()
    for family in text_string_to_metric_families(m.render().decode()):
        names.update(s.name for s in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


def test_dashboard_queries_only_series_the_service_exports():
    dashboard = json.loads((DEPLOY / "grafana" / "apiary.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    asked = {name for e in exprs for name in re.findall(r"\b(?:vllm:[a-z0-9_:]+|apiary_[a-z0-9_]+)", e)}
    missing = asked - exported_names()
    assert not missing, missing
    for required in ("vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
                     "vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_running",
                     "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                     "vllm:generation_tokens_total", "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total",
                     "vllm:spec_decode_num_accepted_tokens_total", "apiary_answers_total",
                     "apiary_escalation_reasons_total", "apiary_device_battery_soc", "apiary_devices_ota_phase"):
        assert required in asked, required
    # quantiles come from histograms, never from gauges
    assert all("histogram_quantile" in e for e in exprs if re.search(r"_p\d\d\b|quantile", e))
    # every panel uses the provisioned data source
    uid = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"][0]["uid"]
    assert {p["datasource"]["uid"] for p in dashboard["panels"] if p["type"] != "row"} == {uid}
