"""The distillation corpus: sensor-agent prompts with the teacher's own answers, plus general text we ship.

Sensor samples are the edge's real work: ``apiary.firmware_bridge.simulator.labelled_situations``
events rendered with ``apiary.shared.prompting.build_messages`` in the teacher's prompt style (the
tuned teacher's short prompt, or the worked examples for an untuned one) and the model's chat
template, answered by the teacher as the cloud answers them: our engine, the base model with
its adapter merged, greedy, the ``Action`` JSON schema enforced. Each record keeps the
simulator's label and the assessment the teacher gave, so distillation can learn only from
answers that are right. General samples are prose from ``deploy/data/general_text.jsonl``
(written for this project, no third-party text), so the student keeps some plain language
beyond the JSON answers and stays usable as a draft model.

A corpus is a JSONL file of :class:`Sample` records. Building it is resumable: answers are
appended a batch at a time and an existing file is continued, not redone. Training and
held-out sets come from different simulator seeds, so evaluation never sees a training hive.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

GENERAL_TEXT = Path(__file__).parent / "data" / "general_text.jsonl"
HELD_OUT_SEED_OFFSET = 1_000_003  # held-out situations use seed + this offset
ANSWER_BATCH = 64  # prompts the engine answers together (one corpus append each)


class CorpusError(ValueError):
    """A corpus file that cannot be read or does not fit the request."""


@dataclass(slots=True)
class Sample:
    kind: str  # "sensor" | "general"
    prompt: str  # chat-templated prompt ("" for general text)
    completion: str  # the teacher's answer (+ end-of-turn token) or the general text itself
    label: str | None = None  # simulator ground truth for sensor samples
    answered: str | None = None  # the assessment in the teacher's answer (None: no valid Action JSON)

    @property
    def text(self) -> str:
        return self.prompt + self.completion

    @property
    def right(self) -> bool:
        return self.kind != "sensor" or (self.label is not None and self.answered == self.label)


def sensor_situations(n: int, seed: int, style: str = "examples",
                      context_drop: float = 0.0) -> list[tuple[list[dict[str, str]], str]]:
    """``n`` simulator situations as (chat messages in prompt ``style``, ground-truth label).

    ``context_drop``: the share of situations whose earlier events are cut to the last k (k drawn
    from 0 .. all but one, deterministically from ``seed``), as a device sees them after a boot
    or a gap: a model trained only on full context reads a missing "change" line as evidence.
    """
    import random

    from apiary.firmware_bridge.simulator import labelled_situations
    from apiary.shared.prompting import build_messages

    rng = random.Random(seed * 7_919 + 17)
    out = []
    for s in labelled_situations(n, seed):
        context = list(s.context)
        if context and rng.random() < context_drop:
            keep = rng.randrange(len(context))
            context = context[len(context) - keep:] if keep else []
        out.append(([m.model_dump() for m in build_messages(s.event, context, style=style)], s.label))
    return out


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


def teacher_engine(teacher: str | Path, adapter: str | Path | None = None) -> Any:
    """The cloud engine on the teacher (``adapter`` merged at load), sized for batch answering."""
    from apiary.cloud.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model_path=Path(teacher), adapter_path=Path(adapter) if adapter else None,
                                  kv_cache_bytes=512 << 20, max_num_seqs=ANSWER_BATCH, max_num_batched_tokens=4096))


def build_sensor_corpus(engine: Any, out: str | Path, n: int, seed: int, *, style: str = "examples",
                        context_drop: float = 0.0, max_tokens: int = 96,
                        on_sample: Callable[[int], None] | None = None) -> list[Sample]:
    """``n`` sensor samples in ``out`` (JSONL), answered by ``engine`` (:func:`teacher_engine`), continuing
    a partial file; returns all of them.

    Answers are greedy under the ``Action`` JSON schema and end with the end-of-turn token, which
    the teacher emits after a complete answer and the student must learn to emit too.
    """
    from apiary.cloud.engine import SamplingParams
    from apiary.cloud.engine.sampling_params import StructuredOutput
    from apiary.shared.prompting import ACTION_JSON_SCHEMA, parse_action

    out = Path(out)
    done = _continue(out)
    if len(done) >= n:
        return done[:n]
    tok = engine.tokenizer
    if tok.eos_token_id is None:
        raise CorpusError("the teacher's tokenizer has no end-of-turn token")
    eos = tok.decode([tok.eos_token_id], skip_special_tokens=False)
    params = SamplingParams(max_tokens=max_tokens,
                            structured=StructuredOutput("json_schema", json.dumps(ACTION_JSON_SCHEMA)))
    situations = sensor_situations(n, seed, style, context_drop)[len(done):]
    out.parent.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(situations), ANSWER_BATCH):
        chunk = situations[start:start + ANSWER_BATCH]
        prompts = [tok.apply_chat_template(messages) for messages, _ in chunk]
        results = engine.generate([tok.encode(p) for p in prompts], params)
        with open(out, "a") as f:
            for prompt, (_, label), r in zip(prompts, chunk, results):
                answer = tok.decode([t for t in r.output_token_ids if t not in tok.stop_token_ids],
                                    skip_special_tokens=False)
                action = parse_action(answer)
                sample = Sample(kind="sensor", prompt=prompt, completion=answer + eos, label=label,
                                answered=action.assessment if action else None)
                f.write(json.dumps(asdict(sample)) + "\n")
                done.append(sample)
            f.flush()
        if on_sample:
            on_sample(len(done))
    return done


def _continue(out: Path) -> list[Sample]:
    """The records already in ``out``, after dropping a last line cut short by a crash."""
    if not out.exists():
        return []
    data = out.read_bytes()
    if data and not data.endswith(b"\n"):
        out.write_bytes(data[: data.rfind(b"\n") + 1])
    return load_corpus(out)


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
                                  label=doc.get("label"), answered=doc.get("answered")))
        except (ValueError, KeyError, TypeError) as e:
            if i == len(lines) - 1:  # a record cut by a crash mid-write: drop it, it is rebuilt
                break
            raise CorpusError(f"{path}:{i + 1}: bad corpus record: {e}") from None
    return samples
