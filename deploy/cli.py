"""`apiary finetune`, `apiary distill`, `apiary quantize`, `apiary image keygen|build|verify|command|rollback|rollout` and
`apiary pki init|issue`: making what runs on devices, and the certificates they connect with."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

DEFAULT_OUT = Path("results") / "distill" / "student"


def _teacher_path(teacher: Optional[Path]) -> Path:
    if teacher is not None:
        return teacher
    from apiary.shared import assets

    return assets.ensure("smollm2-135m-q4")


def _teacher_adapter(choice: str, teacher: Path) -> Optional[Path]:
    """``auto``: the shipped teacher adapter when ``teacher`` is the base it was tuned on; ``none``; or a folder."""
    from apiary.shared import assets

    if choice == "none":
        return None
    if choice != "auto":
        return Path(choice)
    try:
        return assets.adapter_for(teacher)
    except assets.AssetError as e:
        _fail(str(e))
        raise


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def distill_command(
    teacher: Optional[Path] = typer.Option(None, help="Teacher GGUF (default: the SmolLM2-135M Q4 asset)."),
    teacher_adapter: str = typer.Option("auto", help="Task adapter merged into the teacher: auto (the shipped "
                                                     "teacher adapter when the teacher is its base), none, or a "
                                                     "folder written by `apiary finetune`."),
    out: Path = typer.Option(DEFAULT_OUT, help="Working folder: corpus, targets, checkpoint, model/, report.json."),
    layers: int = typer.Option(8, help="Student depth; teacher layers are copied evenly spread (first and last kept)."),
    layer_ids: Optional[str] = typer.Option(None, help="Exact teacher layers to copy, e.g. '0,4,8,29'."),
    steps: int = typer.Option(200, help="Optimizer steps."),
    batch_size: int = typer.Option(8, help="Samples per step."),
    seq_len: int = typer.Option(512, help="General text is cut into pieces of this many tokens."),
    lr: float = typer.Option(3e-4, help="Peak learning rate (warm-up, then cosine to a tenth)."),
    temperature: float = typer.Option(2.0, help="Distillation temperature."),
    alpha_ce: float = typer.Option(0.1, help="Weight of the next-token cross-entropy next to the KL."),
    top_k: int = typer.Option(64, help="Teacher logits kept per position."),
    n_sensor: int = typer.Option(240, help="Simulator situations answered by the teacher for training."),
    n_eval: int = typer.Option(24, help="Held-out situations (other simulated hives) for the agreement report."),
    n_general: Optional[int] = typer.Option(None, help="General-text records to include (default: all)."),
    seed: int = typer.Option(0),
    threads: int = typer.Option(2, help="Torch threads."),
    keep_wrong: bool = typer.Option(False, help="Also learn from teacher answers that miss the simulator's label."),
    context_drop: float = typer.Option(0.25, help="Share of situations asked with fewer earlier events (as after a "
                                                  "boot), so the student does not need full context."),
    qat_steps: int = typer.Option(0, help="Train the last N steps through the INT4 export's rounding (QAT)."),
    qat_qtype: str = typer.Option("q4_0", help="The GGUF block type QAT simulates: q4_0 or q4_1."),
    dtype: str = typer.Option("auto", help="Autocast dtype for the student's matmuls: auto (bf16 where the CPU has it), "
                                           "bfloat16 or float32."),
    checkpoint_every: int = typer.Option(10, help="Steps between checkpoints."),
    resume: bool = typer.Option(True, help="Continue from OUT/checkpoint.pt when present."),
    progress: bool = typer.Option(True, help="Show the progress bar."),
) -> None:
    """Distill the cloud model into a smaller student (resumable); writes a Hugging Face folder the engine loads."""
    from apiary.deploy.distill import DistillConfig, DistillError, distill

    try:
        ids = [int(x) for x in layer_ids.split(",")] if layer_ids else None
        teacher_path = _teacher_path(teacher)
        cfg = DistillConfig(teacher=teacher_path, teacher_adapter=_teacher_adapter(teacher_adapter, teacher_path),
                            out=out, layers=layers, layer_ids=ids, steps=steps,
                            batch_size=batch_size, seq_len=seq_len, lr=lr, temperature=temperature, alpha_ce=alpha_ce,
                            top_k=top_k, n_sensor=n_sensor, n_eval=n_eval, n_general=n_general, seed=seed,
                            threads=threads, keep_wrong=keep_wrong, context_drop=context_drop, dtype=dtype,
                            qat_steps=qat_steps, qat_qtype=qat_qtype,
                            checkpoint_every=checkpoint_every)
        report = distill(cfg, resume=resume, progress=progress)
    except (DistillError, ValueError) as e:
        _fail(str(e))
    after, before = report.eval.get("after", {}), report.eval.get("before", {})
    typer.echo(json.dumps({"model": str(report.model_dir), "student_parameters": report.student_parameters,
                           "teacher_parameters": report.teacher_parameters, "teacher_layers": report.teacher_layers,
                           "steps": report.steps, "train_tokens": report.train_tokens,
                           "first_loss": report.losses[0] if report.losses else None,
                           "last_loss": report.losses[-1] if report.losses else None,
                           "held_out_answer_agreement": {"before": before.get("answer_top1_agreement"),
                                                         "after": after.get("answer_top1_agreement")},
                           "held_out_all_agreement": {"before": before.get("all_top1_agreement"),
                                                      "after": after.get("all_top1_agreement")},
                           "seconds": round(report.seconds, 1)}, indent=1))


def finetune_command(
    base: Optional[Path] = typer.Option(None, help="Base model to tune (default: the SmolLM2-135M Q4 asset)."),
    out: Path = typer.Option(Path("results") / "finetune" / "teacher",
                             help="Working folder: checkpoint.pt, adapter/, report.json."),
    steps: int = typer.Option(120, help="Optimizer steps."),
    batch_size: int = typer.Option(8, help="Situations per step."),
    lr: float = typer.Option(4e-4, help="Peak learning rate (warm-up, then cosine to a tenth)."),
    rank: int = typer.Option(16, help="LoRA rank."),
    alpha: float = typer.Option(32.0, help="LoRA alpha (the update is scaled by alpha / rank)."),
    lora_layers: int = typer.Option(12, help="Adapt the last N layers."),
    train_situations: int = typer.Option(960, help="Simulator situations to learn from (their own seed)."),
    val_situations: int = typer.Option(48, help="Held-out situations for the validation accuracy."),
    labels: list[Path] = typer.Option([], "--labels", help="Operators' labels (apiary fleet export-labels), repeatable."),
    eval_every: int = typer.Option(40, help="Steps between validation runs."),
    checkpoint_every: int = typer.Option(10, help="Steps between checkpoints."),
    seed: int = typer.Option(0),
    threads: Optional[int] = typer.Option(None, help="Torch threads."),
    dtype: str = typer.Option("auto", help="Matmul autocast: auto (bf16 where the CPU has it), bfloat16, float32."),
    resume: bool = typer.Option(True, help="Continue from OUT/checkpoint.pt when present."),
    progress: bool = typer.Option(True, help="Show the progress bar."),
) -> None:
    """Tune the cloud model to the sensor task from labelled situations (LoRA, resumable); the adapter
    is what `apiary cloud serve --adapter` merges at load."""
    from apiary.deploy.finetune import FinetuneConfig, FinetuneError, finetune

    try:
        cfg = FinetuneConfig(base=_teacher_path(base), out=out, steps=steps, batch_size=batch_size, lr=lr, rank=rank,
                             alpha=alpha, lora_layers=lora_layers, train_situations=train_situations,
                             val_situations=val_situations, labels=list(labels), eval_every=eval_every,
                             checkpoint_every=checkpoint_every, seed=seed, threads=threads, dtype=dtype)
        report = finetune(cfg, resume=resume, progress=progress)
    except (FinetuneError, ValueError, OSError) as e:
        _fail(str(e))
    last = report.validation[-1] if report.validation else {}
    typer.echo(json.dumps({"adapter": report.adapter_dir, "steps": report.steps, "autocast": report.autocast,
                           "train_examples": report.train_examples,
                           "prompt_tokens_mean": round(report.prompt_tokens_mean, 1),
                           "first_loss": report.losses[0] if report.losses else None,
                           "last_loss": report.losses[-1] if report.losses else None,
                           "validation_accuracy": last.get("accuracy"), "validation_per_label": last.get("per_label"),
                           "seconds": round(report.seconds, 1)}, indent=1))


def quantize_command(
    folder: Path = typer.Argument(..., help="Hugging Face folder written by `apiary distill` (OUT/model)."),
    out: Optional[Path] = typer.Option(None, help="GGUF to write (default: FOLDER/../student-<qtype>.gguf)."),
    qtype: str = typer.Option("q4_0", help="q4_0 or q4_1."),
    embed_qtype: str = typer.Option("q8_0", help="Token embedding (the tied output head too): q8_0 or q5_0."),
    corpus: Optional[Path] = typer.Option(None, help="JSONL samples to measure on (default: FOLDER/../eval.jsonl "
                                                     "when present, else sensor prompts + general text)."),
    n_eval: int = typer.Option(16, help="Samples for the agreement check (0: skip it)."),
    threads: int = typer.Option(1, help="llama.cpp threads."),
) -> None:
    """Export a student folder to an INT4 GGUF; report its size and top-1 agreement with its float32 self."""
    from apiary.deploy.quantize import QuantizeError, quantize

    out = out or folder.parent / f"{folder.parent.name}-{qtype}.gguf"
    default_corpus = folder.parent / "eval.jsonl"
    corpus = corpus or (default_corpus if default_corpus.is_file() else None)
    try:
        r = quantize(folder, out, qtype, corpus_path=corpus, n_eval=n_eval, threads=threads, embed_qtype=embed_qtype)
    except QuantizeError as e:
        _fail(str(e))
    typer.echo(json.dumps({"gguf": str(r.path), "qtype": r.qtype, "embed_qtype": r.embed_qtype,
                           "prompt_style": r.prompt_style, "size_mib": round(r.size_bytes / 2**20, 2),
                           "fp32_mib": round(r.fp32_bytes / 2**20, 2),
                           "top1_agreement_vs_fp32": r.top1_agreement, "positions": r.positions}, indent=1))


image_app = typer.Typer(help="Signed edge images: keys, build, verify, OTA command, fleet rollout.", no_args_is_help=True)


@image_app.command("keygen")
def keygen(out_dir: Path = typer.Option(Path(".apiary/keys"), help="Folder for NAME.key and NAME.pub."),
           name: str = typer.Option("apiary-image", help="Base name of the key files: NAME.key (private) and NAME.pub.")) -> None:
    """Write an Ed25519 key pair: NAME.key (PKCS#8 PEM, 0600, keep it off devices) and NAME.pub (64 hex)."""
    from apiary.shared.image import ImageError, write_keypair

    try:
        priv, pub = write_keypair(out_dir, name)
    except ImageError as e:
        _fail(str(e))
    typer.echo(f"private key: {priv}\npublic key:  {pub} ({pub.read_text().strip()})")


@image_app.command("build")
def build(model: Path = typer.Argument(..., help="The model file (INT4 GGUF)."),
          version: str = typer.Option(..., help="Image version, e.g. 2025.07.1"),
          key: Path = typer.Option(..., help="Private key (PEM or hex) from `apiary image keygen`."),
          out: Optional[Path] = typer.Option(None, help="Archive to write (default: apiary-image-VERSION.tar)."),
          edge_config: Optional[Path] = typer.Option(None, help="JSON or TOML file with the edge settings to ship."),
          power_profile: str = typer.Option("solar-small", help="Power profile name."),
          threads: int = typer.Option(2, help="llama.cpp threads on the device."),
          n_ctx: int = typer.Option(2048, help="Context length on the device (the edge prompt with context needs ~1.4k).")) -> None:
    """Pack a model with a signed manifest into one archive; print what the OTA command must carry."""
    from apiary.shared.image import ImageError, build_image

    try:
        cfg = _read_config(edge_config) if edge_config else {}
        info = build_image(out or Path(f"apiary-image-{version}.tar"), model, version, key, edge_config=cfg,
                           power_profile={"name": power_profile, "threads": threads, "n_ctx": n_ctx})
    except (ImageError, ValueError) as e:
        _fail(str(e))
    typer.echo(json.dumps({"path": str(info.path), "image_version": version, "sha256": info.sha256,
                           "size": info.size, "signature": info.signature,
                           "model": info.manifest.model.model_dump()}, indent=1))


@image_app.command("verify")
def verify(archive: Path = typer.Argument(...),
           public_key: Path = typer.Option(..., help="Public key (hex or PEM)."),
           sha256: Optional[str] = typer.Option(None, help="Expected archive sha256 (as in the OTA command)."),
           version: Optional[str] = typer.Option(None, help="Expected image version.")) -> None:
    """Check an archive exactly as a device does (hash, signature, manifest, model hash); exit 1 if refused."""
    from apiary.shared.image import ImageError, verify_image

    try:
        info = verify_image(archive, public_key, expected_sha256=sha256, expected_version=version)
    except ImageError as e:
        typer.secho(f"refused ({e.reason}): {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    typer.echo(json.dumps({"ok": True, "sha256": info.sha256, "manifest": info.manifest.model_dump()}, indent=1))


@image_app.command("command")
def ota_command(archive: Path = typer.Argument(...),
                site: str = typer.Option(..., help="Site of the device to update (its MQTT group)."),
                device: str = typer.Option(..., help="Device to update (its node name, e.g. hive-0001)."),
                url: str = typer.Option(..., help="Where the device downloads the archive (the cloud API)."),
                public_key: Path = typer.Option(..., help="Public key, to check the archive before announcing it."),
                broker: Optional[str] = typer.Option(None, help="mqtt://host:port: publish it (else just print it).")) -> None:
    """Build (and optionally publish) the OTA command for an archive, after verifying it."""
    from apiary.shared.image import ImageError, verify_image
    from apiary.shared.protocol import OtaCommand

    try:
        info = verify_image(archive, public_key)
        cmd = OtaCommand(site=site, device=device, image_version=info.manifest.image_version, url=url,
                         sha256=info.sha256, signature=info.signature, size=info.size)
    except (ImageError, ValueError) as e:
        _fail(str(e))
    typer.echo(cmd.model_dump_json(indent=1))
    if broker:
        from apiary.shared import topics
        from apiary.shared.config import MqttConfig
        from apiary.shared.protocol import make
        from apiary.shared.transport import MqttTransport

        with MqttTransport(MqttConfig.from_url(broker), f"apiary-ota-{site}-{device}", persistent=False) as t:
            ok = t.publish(topics.ota_command(site, device), make(cmd, sender="apiary-image"), qos=1, timeout=10)
        if not ok:
            _fail("the broker did not acknowledge the OTA command within 10 s")
        typer.echo(f"published on {topics.ota_command(site, device)}")


@image_app.command("rollback")
def rollback(archive: Path = typer.Argument(..., help="The older signed image to go back to."),
             site: str = typer.Option(..., help="Site of the devices (their MQTT group)."),
             device: list[str] = typer.Option(..., help="Device to take back (repeatable): one grant each."),
             operator_key: Path = typer.Option(..., help="An operator's private key (`apiary image keygen`); the "
                                                         "devices trust its public key in [edge.ota] operator_keys."),
             public_key: Path = typer.Option(..., help="The image key's public key, to check the archive first."),
             ttl: float = typer.Option(900.0, min=1.0, help="Seconds the grants stay valid (a device takes each "
                                                            "once, up to 30 days)."),
             url: Optional[str] = typer.Option(None, help="Send through the cloud's REST API (POST /v1/fleet/ota), "
                                                          "e.g. http://127.0.0.1:8000; the archive must be in its "
                                                          "images directory under the same name."),
             api_key: Optional[str] = typer.Option(None, help="With --url: a key with the operator scope."),
             broker: Optional[str] = typer.Option(None, help="Or publish on this broker (mqtt://host:port)..."),
             download_url: Optional[str] = typer.Option(None, help="...with this URL the devices download from.")
             ) -> None:
    """Take devices back to an older image: sign one rollback grant per device with an operator key (for that
    device and image only, until --ttl runs out, once) and send the OTA commands; a device refuses an older image
    without one. Each device then reports committed or rolled_back as for any update."""
    from apiary.shared.image import ImageError, sign_rollback, verify_image
    from apiary.shared.protocol import OtaCommand

    if (url is None) == (broker is None) or (url is not None and not api_key) or (broker and not download_url):
        _fail("give either --url and --api-key (the cloud's REST API) or --broker and --download-url")
    try:
        info = verify_image(archive, public_key)
        commands = [sign_rollback(OtaCommand(site=site, device=d, image_version=info.manifest.image_version,
                                             url=download_url or f"{(url or '').rstrip('/')}/v1/images/{archive.name}", sha256=info.sha256,
                                             signature=info.signature, size=info.size), operator_key, ttl_s=ttl)
                    for d in dict.fromkeys(device)]
    except (ImageError, ValueError) as e:
        _fail(str(e))
    if url is not None:
        import httpx

        with httpx.Client(base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {api_key}"}, timeout=30) as http:
            for cmd in commands:
                body = {"site": site, "device": cmd.device, "image_version": cmd.image_version,
                        "filename": archive.name, "sha256": cmd.sha256, "signature": cmd.signature, "size": cmd.size,
                        "rollback": cmd.rollback.model_dump()}
                try:
                    r = http.post("/v1/fleet/ota", json=body)
                except httpx.HTTPError as e:
                    _fail(f"cannot reach {url}: {e}")
                if r.status_code != 200:
                    _fail(f"the cloud refused the rollback of {site}/{cmd.device} ({r.status_code}): "
                          f"{_error_message(r)}")
                [target] = r.json()["targets"]
                if not target["acked"]:
                    _fail(f"the broker did not acknowledge the rollback command to {site}/{cmd.device}")
                typer.echo(f"rollback of {site}/{cmd.device} to {cmd.image_version} sent on {target['topic']} "
                           f"(grant valid until {_utc(cmd.rollback.expires)}, nonce {cmd.rollback.nonce})")
        return
    from apiary.shared import topics
    from apiary.shared.config import MqttConfig
    from apiary.shared.protocol import make
    from apiary.shared.transport import MqttTransport

    with MqttTransport(MqttConfig.from_url(broker), f"apiary-rollback-{site}", persistent=False) as t:
        for cmd in commands:
            topic = topics.ota_command(site, cmd.device)
            if not t.publish(topic, make(cmd, sender="apiary-image"), qos=1, timeout=10):
                _fail(f"the broker did not acknowledge the rollback command to {site}/{cmd.device} within 10 s")
            typer.echo(f"rollback of {site}/{cmd.device} to {cmd.image_version} published on {topic} "
                       f"(grant valid until {_utc(cmd.rollback.expires)}, nonce {cmd.rollback.nonce})")


def _rollback_grants(http, archive: Path, body: dict, operator_key: Path, ttl: float) -> dict:
    """The request fields of a signed rollback rollout: the archive's sha256 (the cloud refuses another) and one
    grant per target device, the targets of --site/--all read from the fleet API as the cloud resolves them."""
    import httpx

    from apiary.shared.image import ImageError, read_manifest, sha256_file, sign_rollback
    from apiary.shared.protocol import OtaCommand

    try:
        manifest, signature = read_manifest(archive)
        sha256 = sha256_file(archive)
    except (ImageError, OSError) as e:
        _fail(f"--operator-key needs FILENAME as a local copy of the served archive: {e}")
    if body.get("sha256") not in (None, sha256):
        _fail(f"{archive} has sha256 {sha256}, not --sha256 {body['sha256']}")
    nodes = [(n["site"], n["device"]) for n in body.get("devices") or []]
    if not nodes:
        try:
            r = http.get("/v1/fleet/devices", params={"site": body["site"]} if body.get("site") else None)
        except httpx.HTTPError as e:
            _fail(f"cannot reach the cloud: {e}")
        if r.status_code != 200:
            _fail(f"cannot list the fleet ({r.status_code}): {_error_message(r)}")
        nodes = sorted((d["site"], d["device"]) for d in r.json() if d.get("role") == "edge")
    grants = []
    for site, device in nodes:
        cmd = sign_rollback(OtaCommand(site=site, device=device, image_version=manifest.image_version, url="-",  # unsigned: the cloud puts its own
                                       sha256=sha256, signature=signature, size=archive.stat().st_size),
                            operator_key, ttl_s=ttl)
        grants.append({"site": site, "device": device, **cmd.rollback.model_dump()})
    return {"sha256": sha256, "rollback": grants}


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


@image_app.command("rollout")
def rollout(filename: str = typer.Argument(..., help="An image in the cloud's images directory (`cloud serve --images`)."),
            url: str = typer.Option(..., help="The cloud's REST API, e.g. http://127.0.0.1:8000."),
            api_key: str = typer.Option(..., help="A key with the operator scope (`apiary cloud keys create`)."),
            site: Optional[str] = typer.Option(None, help="Target: every known edge device of this site."),
            device: Optional[list[str]] = typer.Option(None, help="Target: SITE/DEVICE, repeatable; the first ones "
                                                                  "are the canaries."),
            all_devices: bool = typer.Option(False, "--all", help="Target: every known edge device."),
            canary: float = typer.Option(0.1, min=0.0, max=1.0, help="Fraction of the targets in the first wave "
                                                                     "(rounded up, at least one device)."),
            wave_size: Optional[int] = typer.Option(None, min=1, help="Devices per later wave (default: all the rest "
                                                                      "in one)."),
            max_failed_pct: float = typer.Option(0.0, min=0.0, max=100.0, help="Abort when more than this % of a "
                                                 "wave rolled back, was refused, failed or timed out."),
            wave_timeout: float = typer.Option(1800.0, help="Seconds a wave's devices have to commit; the ones that "
                                                            "did not count as failed."),
            sha256: Optional[str] = typer.Option(None, help="Refuse unless the served archive has this sha256 (as "
                                                            "`image build` printed it)."),
            poll: float = typer.Option(2.0, min=0.05, help="Seconds between progress checks."),
            operator_key: Optional[Path] = typer.Option(None, help="A rollback to an older image: sign one grant per "
                                                                   "target device with this operator key; FILENAME is "
                                                                   "then a local copy of the served archive."),
            rollback_ttl: float = typer.Option(86400.0, min=1.0, help="With --operator-key: seconds the grants stay "
                                                                      "valid (the whole rollout must fit).")) -> None:
    """Roll an image out through the cloud (POST /v1/fleet/rollouts) in waves, canary first, and print each
    device's progress until the rollout completed (exit 0) or was aborted (exit 1)."""
    import httpx

    body: dict = {"filename": filename, "canary": canary, "wave_size": wave_size, "max_failed_pct": max_failed_pct,
                  "wave_timeout_s": wave_timeout, "sha256": sha256}
    if site is not None:
        body["site"] = site
    if device:
        nodes = [d.split("/", 1) for d in device]
        if any(len(n) != 2 for n in nodes):
            _fail("--device takes SITE/DEVICE")
        body["devices"] = [{"site": s, "device": d} for s, d in nodes]
    if all_devices:
        body["all"] = True
    with httpx.Client(base_url=url.rstrip("/"), headers={"Authorization": f"Bearer {api_key}"}, timeout=30) as http:
        if operator_key is not None:
            body.update(_rollback_grants(http, Path(filename), body, operator_key, rollback_ttl))
            body["filename"] = Path(filename).name
        try:
            r = http.post("/v1/fleet/rollouts", json=body)
        except httpx.HTTPError as e:
            _fail(f"cannot reach {url}: {e}")
        if r.status_code != 201:
            _fail(f"the cloud refused the rollout ({r.status_code}): {_error_message(r)}")
        state = r.json()
        first = sum(d["wave"] == 0 for d in state["devices"])
        typer.echo(f"rollout {state['id']}: {state['image_version']} ({filename}) to {len(state['devices'])} devices "
                   f"in {state['waves']} waves, {first} in the canary wave")
        shown: dict[tuple[str, str], tuple] = {}
        announced = -1  # the last wave a line was printed for
        lost = False  # the cloud did not answer the last poll
        while True:
            for d in state["devices"]:  # in wave order
                seen = (d["phase"], d["progress"] if d["phase"] == "downloading" else None)
                if shown.get((d["site"], d["device"])) != seen and d["phase"] not in ("pending", "skipped"):
                    shown[(d["site"], d["device"])] = seen
                    if d["wave"] > announced:
                        announced = d["wave"]
                        typer.echo(f"wave {announced + 1} of {state['waves']}")
                    pct = f" {seen[1]:.0%}" if seen[1] is not None else ""
                    detail = f" ({d['detail']})" if d["detail"] and d["phase"] != "downloading" else ""
                    typer.echo(f"  {d['site']}/{d['device']}  wave {d['wave'] + 1}  {d['phase']}{pct}{detail}")
            if state["state"] != "running":
                break
            time.sleep(poll)
            try:
                r = http.get(f"/v1/fleet/rollouts/{state['id']}")
            except httpx.HTTPError as e:  # a cloud restart: the rollout is in its store and resumes
                if not lost:
                    typer.secho(f"cannot reach {url} ({e}); trying again every {poll:g} s", fg=typer.colors.YELLOW,
                                err=True)
                lost = True
                continue
            if lost:
                typer.secho(f"{url} answers again", fg=typer.colors.YELLOW, err=True)
                lost = False
            if r.status_code != 200:
                _fail(f"cannot read rollout {state['id']} ({r.status_code}): {_error_message(r)}")
            state = r.json()
    counts = ", ".join(f"{n} {phase}" for phase, n in sorted(state["counts"].items()))
    typer.echo(f"{state['state']}: {state['reason']} ({counts})")
    if state["state"] != "completed":
        raise typer.Exit(1)


def _error_message(response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:300]


def _read_config(path: Path) -> dict:
    import tomllib

    text = path.read_text()
    return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)


pki_app = typer.Typer(help="The fleet's certificates: a CA, broker/API server certificates, one client certificate "
                             "per node (its MQTT identity).", no_args_is_help=True)
PKI_DIR = typer.Option(Path(".apiary/pki"), "--dir", help="The CA's folder (ca.crt, ca.key).")


@pki_app.command("init")
def pki_init(folder: Path = PKI_DIR,
             name: str = typer.Option("apiary-fleet-ca", help="The CA's common name."),
             days: int = typer.Option(3650, min=1, help="Validity in days.")) -> None:
    """Make the fleet's CA: ca.crt (give it to every node and broker) and ca.key (0600; keep it offline)."""
    from apiary.deploy.pki import PkiError, init_ca

    try:
        made = init_ca(folder, name=name, days=days)
    except PkiError as e:
        _fail(str(e))
    typer.echo(f"CA certificate: {made.cert}\nCA key:         {made.key} (keep it off devices and brokers)")


@pki_app.command("issue")
def pki_issue(name: str = typer.Argument(..., help="Common name: the node's name (hive-0001, cloud, bridge) for a "
                                                   "client certificate, the host for a server certificate."),
              folder: Path = PKI_DIR,
              server: bool = typer.Option(False, "--server", help="A server certificate (broker, REST API)."),
              host: Optional[list[str]] = typer.Option(None, "--host", help="Server: an IP address or DNS name it "
                                                                           "answers on (repeatable; default NAME)."),
              out: Optional[Path] = typer.Option(None, help="Where NAME.crt and NAME.key go (default: the CA folder)."),
              days: int = typer.Option(825, min=1, help="Validity in days."),
              role: str = typer.Option("device", help="device | cloud | bridge: what `apiary pki acl` grants it."),
              site: Optional[str] = typer.Option(None, help="A device's site: `apiary pki acl` lets it publish "
                                                            "only there (any site when omitted).")) -> None:
    """Issue NAME.crt and NAME.key signed by the CA. The broker takes a client certificate's name as the MQTT
    username, so the ACL binds the node to its own topics by its certificate."""
    from apiary.deploy.pki import PkiError, issue

    try:
        made = issue(folder, name, server=server, hosts=host, days=days, out=out, role=role, site=site)
    except PkiError as e:
        _fail(str(e))
    typer.echo(f"certificate: {made.cert}\nkey:         {made.key}")


@pki_app.command("acl")
def pki_acl(folder: Path = PKI_DIR,
            out: Path = typer.Option(Path(".apiary/pki/fleet.acl"), help="The ACL file to write (the broker's "
                                                                         "acl_file).")) -> None:
    """Write the broker's ACL from every client certificate issued: each device bound to its own node and site."""
    from apiary.deploy.pki import PkiError, write_acl

    try:
        path = write_acl(folder, out)
    except PkiError as e:
        _fail(str(e))
    typer.echo(f"ACL: {path} (use it as acl_file with deploy/mosquitto/mosquitto-mtls.conf)")


def register(app: typer.Typer) -> None:
    app.command("finetune")(finetune_command)
    app.command("distill")(distill_command)
    app.command("quantize")(quantize_command)
    app.add_typer(image_app, name="image")
    app.add_typer(pki_app, name="pki")
