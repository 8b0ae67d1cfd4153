"""Task accuracy through the real engine: the tuned teacher on labelled situations, as messages or rendered text."""
from __future__ import annotations

from pathlib import Path

import pytest

from apiary.deploy.accuracy import engine_accuracy

pytestmark = pytest.mark.timeout(600)


def test_messages_and_rendered_text_score_the_same(gguf_path: Path, teacher_tokenizer_meta: dict) -> None:
    from apiary.cloud.engine.tokenizer import Tokenizer
    from apiary.deploy.corpus import sensor_situations
    from apiary.shared import assets

    situations = sensor_situations(4, seed=202, style="short")
    messages, labels = [m for m, _ in situations], [label for _, label in situations]
    teacher = assets.shipped("sensor-teacher-lora")
    as_messages = engine_accuracy(gguf_path, messages, labels, adapter=teacher)
    tok = Tokenizer.from_gguf_metadata(teacher_tokenizer_meta)
    as_text = engine_accuracy(gguf_path, [tok.apply_chat_template(m) for m in messages], labels, adapter=teacher)
    assert as_messages == as_text and as_messages["n"] == 4 and as_messages["valid"] == 1.0
    assert as_messages["accuracy"] == 1.0  # the tuned teacher on held-out hives
    assert sum(int(v.split("/")[1]) for v in as_messages["per_label"].values()) == 4


def test_prompts_and_labels_must_pair_up(gguf_path: Path) -> None:
    with pytest.raises(ValueError, match="2 prompts for 1 labels"):
        engine_accuracy(gguf_path, ["a", "b"], ["normal"])
