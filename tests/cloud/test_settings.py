"""The [cloud] section: file, environment, explicit values; bad values fail as CloudError."""
from __future__ import annotations

import pytest
import torch

from apiary.cloud.errors import CloudError
from apiary.cloud.settings import load_settings


def test_file_env_explicit_precedence(tmp_path, monkeypatch):
    cfg = tmp_path / "apiary.toml"
    cfg.write_text('[cloud]\nport = 9000\nbroker = "mqtt://broker.lan:1884"\nmax_waiting = 10\n')
    monkeypatch.setenv("APIARY__CLOUD__MAX_WAITING", "20")
    s = load_settings(cfg, port=None, db="/tmp/x.db")
    assert s.port == 9000 and s.max_waiting == 20 and s.db == "/tmp/x.db"
    assert s.mqtt.host == "broker.lan" and s.mqtt.port == 1884
    assert load_settings(cfg, port=0).port == 0


def test_bad_values(tmp_path):
    with pytest.raises(CloudError, match="broker"):
        load_settings(None, broker="http://nope")
    with pytest.raises(CloudError, match="worker_id"):
        load_settings(None, worker_id="has space")
    with pytest.raises(CloudError, match="unknown_key|extra"):
        load_settings(None, unknown_key=1)
    with pytest.raises(CloudError, match="kv_cache_dtype"):
        load_settings(None, kv_cache_dtype="fp8")
    assert load_settings(None, kv_cache_dtype="int8").kv_cache_dtype == "int8"
    assert load_settings(None, kv_cache_dtype="bf16").kv_cache_dtype == "bf16"


def test_model_name_and_resolution(tmp_path):
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF")
    s = load_settings(None, model=str(model))
    assert s.model_name == "tiny" and s.resolve_model_path() == model
    assert load_settings(None, model=str(model), served_model_name="bees").model_name == "bees"
    with pytest.raises(CloudError, match="neither an existing path"):
        load_settings(None, model="no-such-model").resolve_model_path()


def test_speculative_settings(tmp_path):
    from apiary.cloud.engine import SpeculativeConfig

    assert load_settings(None).speculative_config() is None  # off unless asked for
    ngram = load_settings(None, speculative="ngram", spec_k=4).speculative_config()
    assert isinstance(ngram, SpeculativeConfig) and ngram.method == "ngram" and ngram.k == 4
    with pytest.raises(CloudError, match="needs draft_model"):
        load_settings(None, speculative="draft").speculative_config()
    student = tmp_path / "student"
    student.mkdir()
    own = load_settings(None, speculative="draft", draft_model=str(student)).speculative_config()
    assert own.draft_model_path == student and own.draft_num_layers is None  # a real draft runs whole
    with pytest.raises(CloudError, match="speculative"):
        load_settings(None, speculative="sometimes")
    with pytest.raises(CloudError, match="neither an existing path"):
        load_settings(None, speculative="draft", draft_model="no-such-draft").speculative_config()


def test_the_worker_keeps_one_identity_and_a_persistent_session_across_restarts(tmp_path):
    """Resuming unfinished claims and the broker's queue for a worker that is away both need its id to be
    the same in the next process."""
    import subprocess
    import sys

    s = load_settings(None)
    assert s.persistent_session is True and s.session_expiry_s == 300  # the edge's escalation deadline
    code = "from apiary.cloud.settings import load_settings; print(load_settings(None).worker_id)"
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert again.stdout.strip() == s.worker_id


def test_cuda_graphs_is_a_setting_the_engine_receives(tmp_path):
    from apiary.cloud.service import build_engine
    from tests.cloud.engine.tiny import make_checkpoint

    cfg = tmp_path / "apiary.toml"
    cfg.write_text("[cloud]\ncuda_graphs = false\n")
    assert load_settings(None).cuda_graphs is True
    settings = load_settings(cfg, model=str(make_checkpoint(tmp_path / "tiny")), adapter="none", kv_cache_mb=4)
    assert settings.cuda_graphs is False
    engine = build_engine(settings)
    try:
        assert engine._engine.config.cuda_graphs is False
    finally:
        engine.shutdown()
    with pytest.raises(CloudError, match="cuda_graphs"):
        load_settings(None, cuda_graphs="sometimes")


def test_head_is_a_setting_the_engine_receives(tmp_path):
    """``[cloud] head`` / ``--head``: ``auto`` (a bf16 engine's head ranks in int8 where the grouped kernel runs,
    ``int8.RefinedHead``), ``dtype`` (the head in the engine's dtype)."""
    from apiary.cloud.engine import int8
    from apiary.cloud.service import build_engine
    from tests.cloud.engine.tiny import make_checkpoint

    assert load_settings(None).head == "auto"
    with pytest.raises(CloudError, match="head"):
        load_settings(None, head="int4")
    model = str(make_checkpoint(tmp_path / "tiny"))
    for head in ("auto", "dtype"):
        engine = build_engine(load_settings(None, model=model, adapter="none", kv_cache_mb=4, dtype="bfloat16",
                                            head=head))
        try:
            assert engine._engine.config.head == head
            refined = isinstance(engine._engine.runner.model.head, int8.RefinedHead)
            assert refined == (head == "auto" and int8.gemm_choice().backend == "grouped")
        finally:
            engine.shutdown()


def test_bf16_weights_are_a_setting_the_engine_receives(tmp_path):
    """``[cloud] weights = "bf16"`` / ``--weights bf16``: a float32 engine's projections hold bf16 weights and sum in
    float32 where numba compiles the kernel (AVX2 + FMA); a bad value is refused."""
    from apiary.cloud.engine.linear import Linear
    from apiary.cloud.service import build_engine
    from apiary.kernels import ops
    from tests.cloud.engine.tiny import make_checkpoint

    assert load_settings(None).weights == "auto"  # bf16-held where dtype auto is float32 (model_runner.resolve_weights)
    with pytest.raises(CloudError, match="weights"):
        load_settings(None, weights="bf8")
    if not ops.bf16w_gemm_available():
        pytest.skip("numba does not compile for AVX2 and FMA here: the bf16-weight kernel does not run")
    model = str(make_checkpoint(tmp_path / "tiny"))
    engine = build_engine(load_settings(None, model=model, adapter="none", kv_cache_mb=4, dtype="float32",
                                        weights="bf16"))
    try:
        layer = engine._engine.runner.model.layers[0]
        assert engine._engine.config.weights == "bf16"
        assert isinstance(layer.qkv, Linear) and layer.qkv.weight.dtype == torch.bfloat16
        assert layer.qkv.takes == torch.float32 and "cpu_bf16w_gemm" in layer.qkv.path
    finally:
        engine.shutdown()
