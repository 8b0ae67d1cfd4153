"""The REST API over HTTPS (`cloud serve --tls-cert/--tls-key`), with certificates from `apiary pki`."""
from __future__ import annotations

import ssl

import httpx
import pytest

from apiary.cloud.errors import CloudError
from apiary.cloud.settings import load_settings
from apiary.deploy.pki import init_ca, issue

pytestmark = pytest.mark.timeout(120)


def test_the_api_serves_https_with_a_fleet_certificate(make_service, tmp_path) -> None:
    ca = init_ca(tmp_path / "pki")
    server = issue(tmp_path / "pki", "api", server=True, hosts=["127.0.0.1"])
    service = make_service(tls_cert=str(server.cert), tls_key=str(server.key))
    assert service.url.startswith("https://127.0.0.1:")
    with httpx.Client(verify=ssl.create_default_context(cafile=str(ca.cert)), timeout=10) as c:
        assert c.get(f"{service.url}/healthz").status_code == 200
    with pytest.raises(httpx.TransportError):  # plain HTTP to a TLS port gets no answer
        httpx.get(service.url.replace("https://", "http://") + "/healthz", timeout=5).raise_for_status()


def test_tls_settings_come_in_pairs_of_existing_files(tmp_path) -> None:
    (tmp_path / "api.crt").write_text("x")
    for fields, message in [(dict(tls_cert=str(tmp_path / "api.crt")), "go together"),
                            (dict(tls_cert=str(tmp_path / "api.crt"), tls_key=str(tmp_path / "none.key")),
                             "TLS file not found")]:
        with pytest.raises(CloudError, match=message):
            load_settings(None, db=str(tmp_path / "c.db"), **fields)
