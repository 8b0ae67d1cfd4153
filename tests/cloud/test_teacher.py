"""The cloud's task-tuned teacher: the shipped LoRA adapter is merged by default and answers escalations
in its own short prompt, better than the base model, through the real MQTT entry point."""
from __future__ import annotations

from pathlib import Path

import pytest

from apiary.cloud.errors import CloudError
from apiary.cloud.settings import CloudSettings
from apiary.shared import assets
from apiary.shared.protocol import InferenceRequest
from apiary.shared.prompting import build_messages

HELD_OUT_SEED = 505  # used by no training, validation or benchmark split


def test_the_shipped_teacher_is_served_by_default_only_on_its_base(gguf_path: Path, tmp_path: Path) -> None:
    teacher = assets.shipped("sensor-teacher-lora")
    assert CloudSettings(model=str(gguf_path)).resolve_adapter_path(gguf_path) == teacher
    assert CloudSettings(model=str(gguf_path), adapter="none").resolve_adapter_path(gguf_path) is None
    other = tmp_path / "other.gguf"
    other.write_bytes(b"another model")
    assert CloudSettings(model=str(other)).resolve_adapter_path(other) is None  # auto: not its base
    assert CloudSettings(adapter=str(teacher)).resolve_adapter_path(gguf_path) == teacher
    with pytest.raises(CloudError, match="neither a folder"):
        CloudSettings(adapter=str(tmp_path / "missing")).resolve_adapter_path(gguf_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_escalations_are_answered_by_the_tuned_teacher(mosquitto, tmp_path: Path, gguf_path: Path) -> None:
    """`cloud serve` defaults: the teacher reads the short prompt (whatever the edge's model needed) and
    gets held-out situations of every label right."""
    from apiary.cloud.service import CloudService
    from apiary.firmware_bridge.simulator import labelled_situations
    from tests.cloud.test_mqtt import Edge

    service = CloudService(CloudSettings(port=0, broker=mosquitto.config.url, db=str(tmp_path / "cloud.db"),
                                         api_key_file=None, generate_key="never", model=str(gguf_path),
                                         images=str(tmp_path / "images"), worker_concurrency=12, record=False,
                                         kv_cache_mb=256))
    service.start()
    edge = Edge(mosquitto.config, client_id="edge-teacher")
    try:
        assert service.engine.prompt_style == "short"
        situations = labelled_situations(12, seed=HELD_OUT_SEED)
        ids = []
        for i, s in enumerate(situations):
            req = InferenceRequest(request_id=f"t-{i}", site=s.event.site, device=s.event.device,
                                   messages=build_messages(s.event, s.context),  # the edge's own (examples) prompt
                                   event=s.event, context=s.context, max_tokens=128, priority=3,
                                   response_format="json_action")
            edge.escalate(req)
            ids.append(req.request_id)
        edge.wait(ids, timeout=400)
        right = 0
        for rid, s in zip(ids, situations):
            result = edge.replies[rid][0].body
            assert result.status == "ok" and result.action is not None, result
            assert result.prompt_tokens < 400  # the short prompt, not the ~1,400-token one the edge sent
            right += result.action["assessment"] == s.label
        assert right >= 11, f"{right}/12"
    finally:
        edge.t.stop()
        service.stop()
