"""The distillation corpus: sensor-agent prompts with the teacher's own answers, plus general text we ship.

Sensor samples are the edge's real work: ``firmware_bridge.simulator.labelled_situations``
events rendered with ``shared.prompting.build_messages`` (the prompt both tiers use) and the
model's chat template, answered by the teacher exactly as the edge answers (``edge.model``:
llama.cpp, greedy, action grammar). General samples are prose from
``deploy/data/general_text.jsonl`` (written for this project, no third-party text), so the
student keeps some plain language beyond the JSON answers.

A corpus is a JSONL file of :class:`Sample` records. Building it is resumable: samples are
appended one by one and an existing file is continued, not redone. Training and held-out
sets come from different simulator seeds, so evaluation never sees a training hive.
"""
from __future__ import annotations

import json
from contextlib import closing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

GENERAL_TEXT = Path(__file__).parent / "data" / "general_text.jsonl"
HELD_OUT_SEED_OFFSET = 1_000_003  # held-out situations use seed + this offset


class CorpusError(ValueError):
    """A corpus file that cannot be read or does not fit the request."""


@dataclass(slots=True)
class Sample:
    kind: str  # "sensor" | "general"
    prompt: str  # chat-templated prompt ("" for general text)
    completion: str  # the teacher's answer (+ end-of-turn token) or the general text itself
    label: str | None = None  # simulator ground truth for sensor samples

    @property
    def text(self) -> str:
        return self.prompt + self.completion


def chat_template_renderer(tokenizer_meta: dict[str, Any]) -> Callable[[list[dict[str, str]]], str]:
    """The teacher's own chat template (from its GGUF tokenizer metadata), as the engine renders it."""
    from cloud.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(tokenizer_meta)
    return lambda messages: tok.apply_chat_template(messages, add_generation_prompt=True)


def sensor_situations(n: int, seed: int) -> list[tuple[list[dict[str, str]], str]]:
    """``n`` simulator situations as (chat messages, ground-truth label)."""
    from firmware_bridge.simulator import labelled_situations
    from shared.prompting import build_messages

    return [([m.model_dump() for m in build_messages(s.event, s.context)], s.label)
            for s in labelled_situations(n, seed)]


def general_samples(path: str | Path = GENERAL_TEXT) -> list[Sample]:
    samples = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            samples.append(Sample(kind="general", prompt="", completion=f"{doc['title']}\n\n{doc['text']}\n"))
        except (ValueError, KeyError, TypeError) as e:
            raise CorpusError(f"{path}:{i + 1}: not a {{title, text}} record: {e}") from None
    return samples


def teacher_answers(teacher_gguf: str | Path, prompts: list[list[dict[str, str]]], *, max_tokens: int = 96,
                    threads: int = 2) -> Iterator[str]:
    """The teacher's answer to each chat, produced the way the edge answers (grammar, greedy)."""
    from edge.model import LocalModel
    from shared.protocol import ChatMessage

    model = LocalModel(teacher_gguf, n_ctx=2048, threads=threads)
    try:
        for messages in prompts:
            gen = model.generate([ChatMessage(**m) for m in messages], max_tokens=max_tokens)
            yield gen.text + ("<|im_end|>\n" if gen.finished else "")
    finally:
        model.close()


def build_sensor_corpus(teacher_gguf: str | Path, out: str | Path, n: int, seed: int, *,
                        render: Callable[[list[dict[str, str]]], str], max_tokens: int = 96, threads: int = 2,
                        on_sample: Callable[[int], None] | None = None) -> list[Sample]:
    """``n`` sensor samples in ``out`` (JSONL), continuing a partial file; returns all of them.

    ``render`` turns chat messages into the prompt text (:func:`chat_template_renderer`).
    """
    out = Path(out)
    if out.exists():  # drop a record cut short by a crash, so appending continues cleanly
        data = out.read_bytes()
        if data and not data.endswith(b"\n"):
            out.write_bytes(data[: data.rfind(b"\n") + 1])
    done = load_corpus(out) if out.exists() else []
    if len(done) >= n:
        return done[:n]
    situations = sensor_situations(n, seed)[len(done):]
    out.parent.mkdir(parents=True, exist_ok=True)
    answers = teacher_answers(teacher_gguf, [m for m, _ in situations], max_tokens=max_tokens, threads=threads)
    with open(out, "a") as f, closing(answers):
        for (messages, label), answer in zip(situations, answers):
            sample = Sample(kind="sensor", prompt=render(messages), completion=answer, label=label)
            f.write(json.dumps(asdict(sample)) + "\n")
            f.flush()
            done.append(sample)
            if on_sample:
                on_sample(len(done))
    return done


def load_corpus(path: str | Path) -> list[Sample]:
    samples = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise CorpusError(f"cannot read corpus {path}: {e}") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            doc: dict[str, Any] = json.loads(line)
            samples.append(Sample(kind=doc["kind"], prompt=doc["prompt"], completion=doc["completion"],
                                  label=doc.get("label")))
        except (ValueError, KeyError, TypeError) as e:
            if i == len(lines) - 1:  # a record cut by a crash mid-write: drop it, it is rebuilt
                break
            raise CorpusError(f"{path}:{i + 1}: bad corpus record: {e}") from None
    return samples
