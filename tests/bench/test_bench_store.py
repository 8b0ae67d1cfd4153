"""``apiary bench store`` through its real entry point: SQLite and a throwaway PostgreSQL cluster, one and two
recorders; every event stored exactly once whatever the number of recorders."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from apiary.bench.pgserver import find_bin_dir
from apiary.cli import app

pytestmark = pytest.mark.timeout(300)


@pytest.mark.skipif(find_bin_dir() is None, reason="PostgreSQL server binaries (initdb, pg_ctl) not found: "
                                                   "run .ci/install (it installs Debian's postgresql)")
def test_store_bench_records_every_event_once_on_both_backends(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # results/bench/store.json lands here
    result = CliRunner().invoke(app, ["bench", "store", "--events", "60", "--devices", "4", "--recorders", "1,2"])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "results" / "bench" / "store.json").read_text())
    got = {(r["backend"], r["recorders"]): r for r in record["results"]}
    assert set(got) == {("sqlite", 1), ("sqlite", 2), ("postgresql", 1), ("postgresql", 2)}
    for (_, recorders), r in got.items():
        assert r["stored"] == 60 and r["duplicates"] == 60 * (recorders - 1) and r["events_per_s"] > 0
    assert record["machine"]["cpu_features"] is not None


def test_bad_backend_is_a_clear_error() -> None:
    result = CliRunner().invoke(app, ["bench", "store", "--backends", "oracle"])
    assert result.exit_code == 2 and "--backends" in result.output
