"""``apiary bench engine``: busy processes beside each run, and a tiny end-to-end run with them.

No timing thresholds: what is checked is that the busy processes really run during a system's run
and are gone after it, and that the table and JSON carry the contention setting, each system's CPU
use and the CPU's features.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from apiary.bench import engine as bench_engine
from apiary.kernels import cpu


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_busy_processes_run_during_the_block_and_are_stopped_after() -> None:
    with bench_engine.busy_processes(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None and _alive(p.pid) for p in procs)
        before = [p.pid for p in procs]
    assert all(p.poll() is not None for p in procs)
    assert not any(_alive(pid) for pid in before)
    with bench_engine.busy_processes(0) as none:
        assert none == []


@pytest.mark.timeout(300)
def test_a_tiny_run_with_background_reports_contention_cpu_use_and_features(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.cloud.engine.tiny import make_checkpoint

    model = make_checkpoint(tmp_path / "tiny", "llama")
    monkeypatch.chdir(tmp_path)
    app = typer.Typer()
    app.command()(bench_engine.command)
    result = CliRunner().invoke(app, ["--model", str(model), "--systems",
                                      "engine,engine-kv8,engine-ngram,engine-bf16w,engine-bf16w-kv32",
                                      "--requests", "3", "--prompt-tokens", "8-16", "--output-tokens", "4-8",
                                      "--threads", "1", "--background", "1", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert "1 busy processes beside it" in result.output
    record = json.loads((tmp_path / "results" / "bench" / "engine.json").read_text())
    assert record["background_processes"] == 1
    assert record["columns"][4] == "CPU %" and record["rows"][0][0] == "engine"
    assert record["cpu_percent_per_round"]["engine"][0] == record["rows"][0][4]
    assert record["machine"]["cpu_features"] == cpu.relevant(cpu.host_flags())
    assert record["engine_threads"].startswith("1 threads (affinity")  # --threads 1 reached the engine
    assert "features:" in result.output
    kv8 = dict(zip(record["columns"], record["rows"][1]))  # the same engine with int8 KV rows: more tokens per byte
    assert kv8["system"] == "engine-kv8" and kv8["output tok"] == record["rows"][0][1]
    held = re.search(r"int8 KV cache \(([\d,]+) tokens in 2 GiB against ([\d,]+) with float32 rows\)",
                     record["systems"]["engine-kv8"])
    assert held and int(held[1].replace(",", "")) > 2 * int(held[2].replace(",", "")), record["systems"]
    ngram = dict(zip(record["columns"], record["rows"][2]))  # n-gram speculation: the same tokens, counted alike
    assert ngram["system"] == "engine-ngram" and ngram["output tok"] == record["rows"][0][1]
    assert "n-gram speculation (acceptance" in record["systems"]["engine-ngram"]
    bf16w = dict(zip(record["columns"], record["rows"][3]))  # float32 with bf16-held weights, its floor float32's
    assert bf16w["system"] == "engine-bf16w" and bf16w["output tok"] == record["rows"][0][1]
    assert "weights held in bf16" in record["systems"]["engine-bf16w"]
    assert record["matmul_floor"]["engine-bf16w"]["dtype"] == "float32"
    assert record["systems"]["engine-bf16w"].endswith("bfloat16 KV rows")  # kv_cache_dtype auto: bf16 rows for it
    kv32 = dict(zip(record["columns"], record["rows"][4]))  # ... and the A/B with float32 rows
    assert kv32["system"] == "engine-bf16w-kv32" and kv32["output tok"] == record["rows"][0][1]
    assert re.search(r"float32 KV rows \([\d,]+ tokens in 2 GiB\)", record["systems"]["engine-bf16w-kv32"])
    floor = record["matmul_floor"]["engine"]  # bench.floor: its projection FLOPs at this CPU's float32 rate
    assert record["columns"][-4:] == ["matmul floor s", "% of floor", "prompt steps % of floor",
                                      "decode steps % of floor (roofline)"]
    assert floor["dtype"] == "float32" and floor["gflops"] > 0 and floor["seconds"] > 0
    assert record["rows"][0][-4] == round(floor["seconds"], 1) and record["rows"][0][-3].endswith("%")
    # each kind of step against its own floor: the engine's step accounting (EngineStats.record_step)
    prompt, decode = floor["prompt_steps"], floor["decode_steps"]
    assert 0 < prompt["floor_seconds"] < prompt["seconds"] and 0 < decode["floor_seconds"] < decode["seconds"]
    assert decode["stream_gbps"] > 0 and 0 < decode["memory_floor_seconds"] < decode["seconds"]
    assert decode["roofline_fraction"] == max(decode["floor_seconds"], decode["memory_floor_seconds"]) / decode["seconds"]
    assert record["rows"][0][-2] == f"{prompt['fraction']:.0%}"
    assert record["rows"][0][-1] == f"{decode['fraction']:.0%} ({decode['roofline_fraction']:.0%})"


def test_int8_systems_are_skipped_with_the_reason_where_the_cpu_has_no_fast_int8_gemm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from apiary.cloud.engine import int8

    monkeypatch.setattr(int8, "gemm_choice", lambda: int8.GemmChoice(None, (), "oneDNN -> float32 inexact"))
    monkeypatch.chdir(tmp_path)
    app = typer.Typer()
    app.command()(bench_engine.command)
    result = CliRunner().invoke(app, ["--systems", "engine-int8,engine-int8-fp32", "--requests", "1"])
    assert result.exit_code != 0
    assert "skipping engine-int8, engine-int8-fp32: no fast int8 GEMM on this CPU (oneDNN -> float32 inexact)" in result.output
    assert "no system left to run" in result.output and not (tmp_path / "results").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_http_systems_serve_the_same_requests_and_report_ratio_rss_and_warm_up(tmp_path: Path, gguf_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``--systems cloud-http,llama-server`` (and their ``-ngram`` twins): each server started as its own process,
    the same streamed requests (every one exactly max_tokens long), the ratio between them, the servers' peak
    RSS and their warm-up probes. Without a built llama-server, ours alone (the ratio column then says "-"). The
    engine alone beside them at more requests in flight than the clients: the run says so and records each
    system's concurrency."""
    from apiary.bench.http_serving import LLAMA_SERVER, WARMUP_PROBES

    systems = ["cloud-http", "cloud-http-ngram", "engine"] + (["llama-server", "llama-server-ngram"]
                                                             if LLAMA_SERVER.is_file() else [])
    build = tmp_path / "builds" / "llama-server"  # another build of it, as a rehearsal of another CPU passes
    if LLAMA_SERVER.is_file():
        build.parent.mkdir()
        build.symlink_to(LLAMA_SERVER)
    monkeypatch.chdir(tmp_path)
    app = typer.Typer()
    app.command()(bench_engine.command)
    result = CliRunner().invoke(app, ["--model", str(gguf_path), "--systems", ",".join(systems), "--requests", "4",
                                      "--prompt-tokens", "16-48", "--output-tokens", "4-12", "--clients", "2",
                                      "--threads", "2", "--dtype", "float32", "--llama-server", str(build)])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "results" / "bench" / "engine.json").read_text())
    rows = {row[0]: dict(zip(record["columns"], row)) for row in record["rows"]}
    assert set(rows) == set(systems)
    assert record["requests_in_flight"] == {s: 64 if s == "engine" else 2 for s in systems}
    assert "note: engine ran up to 64 requests at a time, the HTTP systems 2 clients" in result.output
    for system in set(systems) - {"engine"}:
        assert rows[system]["output tok"] == record["workload"]["output_tokens"]  # ignore_eos: exactly max_tokens
        assert rows[system]["peak RSS MB"] > 50
        (probes,) = record["http"][system]["warmup_ttfts_per_round"]
        assert len(probes) == WARMUP_PROBES and all(t > 0 for t in probes)
        assert f"{system} warm-up: first request's TTFT" in result.output
    # our servers' steps by kind (GET /healthz before and after the run) against their floors; llama.cpp's have none
    for system in ("cloud-http", "cloud-http-ngram"):
        kinds = record["matmul_floor"][system]
        assert 0 < kinds["prompt_steps"]["floor_seconds"] < kinds["prompt_steps"]["seconds"]
        assert 0 < kinds["decode_steps"]["roofline_fraction"] <= 1 and rows[system]["prompt steps % of floor"].endswith("%")
    assert all(rows[s]["prompt steps % of floor"] == "-" for s in rows if s.startswith("llama-server"))
    # both servers once more with n-gram speculation, llama.cpp's at our proposer's lookup and draft lengths
    assert "--speculative ngram" in record["systems"]["cloud-http-ngram"]
    if "llama-server" in rows:
        assert f"llama-server ({build})" in record["systems"]["llama-server"]
        assert "--spec-type ngram-simple --spec-ngram-simple-size-n 4" in record["systems"]["llama-server-ngram"]
        expected = rows["cloud-http"]["output tok/s"] / rows["llama-server"]["output tok/s"]
        assert rows["cloud-http"]["x llama-server"] == pytest.approx(expected, rel=0.02)
    else:
        assert rows["cloud-http"]["x llama-server"] == "-"


def test_a_missing_llama_server_build_is_named(tmp_path: Path, gguf_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--llama-server PATH`` that holds no binary: the run stops before starting anything, naming the path."""
    monkeypatch.chdir(tmp_path)
    app = typer.Typer()
    app.command()(bench_engine.command)
    missing = tmp_path / "nowhere" / "llama-server"
    result = CliRunner().invoke(app, ["--model", str(gguf_path), "--systems", "llama-server", "--requests", "2",
                                      "--llama-server", str(missing)], env={"COLUMNS": "400"})
    assert result.exit_code == 2 and not (tmp_path / "results").exists()
    assert f"no llama-server at {missing}: run bash deploy/build_llama_server.sh" in result.output


def test_warm_up_probes_are_alike_in_length_and_share_no_prefix() -> None:
    """Ten probes of one length, each starting with another token: a prompt cache cannot make a later one cheaper
    (the same prompt ten times made llama-server's tenth TTFT 0.02 s against the first's 5.7 s)."""
    from apiary.bench.http_serving import WARMUP_PROBES, probe_prompts

    for n_requests in (3, 12):
        work = [bench_engine.Request(prompt=list(range(100 * i, 100 * i + 20 + i)), max_tokens=4)
                for i in range(n_requests)]
        probes = probe_prompts(work)
        assert len(probes) == WARMUP_PROBES and {len(p) for p in probes} == {20}
        assert len({p[0] for p in probes}) == WARMUP_PROBES
