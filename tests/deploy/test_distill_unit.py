"""Distillation pieces on small tensors: the loss, the data order, the schedule, the corpus file, the settings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deploy import corpus
from deploy.distill import DistillConfig, DistillError, TokenSample, distill_loss, lr_at, sample_order, tokenize


def test_kl_over_all_tokens_equals_torch_kl_div() -> None:
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    ids, mask = torch.randint(0, 11, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    t_val, t_idx = t.topk(11, dim=-1)  # k = vocab: the exact KL
    loss, kl, ce = distill_loss(s, ids, mask, t_idx.int(), t_val, temperature=2.0, alpha_ce=0.0)
    expected = F.kl_div(F.log_softmax(s / 2, -1).flatten(0, 1), F.log_softmax(t / 2, -1).flatten(0, 1),
                        log_target=True, reduction="batchmean") * 4
    assert kl == pytest.approx(float(expected), rel=1e-5) and float(loss) == pytest.approx(kl, rel=1e-6)
    assert ce == pytest.approx(float(F.cross_entropy(s[:, :-1].flatten(0, 1), ids[:, 1:].flatten())), rel=1e-5)


def test_loss_is_zero_when_the_student_is_the_teacher_and_ignores_padding() -> None:
    torch.manual_seed(1)
    t = torch.randn(1, 6, 50)
    t_val, t_idx = t.topk(50, dim=-1)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    garbage = t.clone()
    garbage[:, 4:] = 1e4  # padded positions: whatever is there must not count
    _, kl, _ = distill_loss(garbage, torch.zeros(1, 6, dtype=torch.long), mask, t_idx.int(), t_val, 1.0, 0.0)
    assert abs(kl) < 1e-5


def test_top_k_kl_is_taken_on_the_teachers_top_tokens() -> None:
    logits = torch.full((1, 1, 100), -10.0)
    logits[..., 7] = 10.0
    t_val, t_idx = logits.topk(4, dim=-1)
    student_right, student_wrong = logits.clone(), logits.clone()
    student_wrong[..., 7], student_wrong[..., 8] = -10.0, 10.0
    args = (torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), t_idx.int(), t_val, 1.0, 0.0)
    assert distill_loss(student_right, *args)[1] < 1e-3 < 5 < distill_loss(student_wrong, *args)[1]


def test_sample_order_is_a_resumable_stream_of_epochs() -> None:
    stream = sample_order(10, seed=3, position=0, count=30)
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert stream[:10] != stream[10:20]  # reshuffled each epoch
    assert sample_order(10, 3, 17, 5) == stream[17:22]  # a resumed run sees exactly what it would have seen
    assert sample_order(10, 4, 0, 10) != stream[:10]


def test_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    cfg = DistillConfig(teacher=Path(__file__), out=Path("unused"), steps=100, lr=1e-3, warmup_steps=10)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(1e-4, rel=0.01)


@pytest.mark.parametrize("field,value,message", [
    ("steps", 0, "steps"), ("batch_size", 0, "batch_size"), ("seq_len", 4, "seq_len"), ("lr", 0.0, "lr"),
    ("temperature", 0.0, "temperature"), ("alpha_ce", -1.0, "alpha_ce"), ("top_k", 0, "top_k"),
    ("n_sensor", -1, "n_sensor"), ("dtype", "float16", "dtype"), ("checkpoint_every", 0, "checkpoint_every"),
])
def test_bad_settings_are_refused(field: str, value, message: str) -> None:
    with pytest.raises(DistillError, match=message):
        DistillConfig(teacher=Path(__file__), out=Path("unused"), **{field: value})
    with pytest.raises(DistillError, match="not found"):
        DistillConfig(teacher=Path("/no/such/teacher.gguf"), out=Path("unused"))


def test_general_text_ships_and_is_cut_into_samples(teacher_tokenizer_meta: dict) -> None:
    from cloud.engine.tokenizer import Tokenizer

    samples = corpus.general_samples()
    assert len(samples) >= 10 and sum(len(s.text) for s in samples) > 20_000
    assert all(s.kind == "general" and s.prompt == "" for s in samples)
    tok = Tokenizer.from_gguf_metadata(teacher_tokenizer_meta)
    pieces = tokenize(tok, samples[:3], seq_len=64)
    assert all(isinstance(p, TokenSample) and 8 < len(p.ids) <= 64 and p.answer_start == 0 for p in pieces)
    assert len(pieces) > 3
    sensor = corpus.Sample(kind="sensor", prompt="<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                           completion='{"assessment": "normal"}<|im_end|>\n')
    [p] = tokenize(tok, [sensor], seq_len=512)
    assert tok.decode(p.ids[p.answer_start + 1:], skip_special_tokens=False).startswith('{"assessment"')


def test_corpus_file_recovers_from_a_cut_record_and_rejects_garbage(tmp_path: Path) -> None:
    good = {"kind": "sensor", "prompt": "p", "completion": "c", "label": "normal"}
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(good)[:20])  # the process died mid-write
    assert corpus.load_corpus(path) == [corpus.Sample("sensor", "p", "c", "normal")]
    path.write_text("not json\n" + json.dumps(good) + "\n")
    with pytest.raises(corpus.CorpusError, match="line|:1"):
        corpus.load_corpus(path)
    with pytest.raises(corpus.CorpusError):
        corpus.load_corpus(tmp_path / "missing.jsonl")
    bad_general = tmp_path / "general.jsonl"
    bad_general.write_text('{"title": "x"}\n')
    with pytest.raises(corpus.CorpusError, match="title, text"):
        corpus.general_samples(bad_general)


def test_sensor_situations_use_the_shared_prompt() -> None:
    from shared.prompting import SYSTEM_PROMPT

    situations = corpus.sensor_situations(6, seed=1)
    assert len(situations) == 6 and len({label for _, label in situations}) == 6
    for messages, label in situations:
        assert messages[0] == {"role": "system", "content": SYSTEM_PROMPT} and messages[1]["role"] == "user"
    assert corpus.sensor_situations(6, seed=1) == situations  # deterministic
    held_out = corpus.sensor_situations(6, seed=1 + corpus.HELD_OUT_SEED_OFFSET)
    overlap = {m[1]["content"] for m, _ in held_out} & {m[1]["content"] for m, _ in situations}
    assert len(overlap) <= 1  # other hives; an identical rounded report is possible, a shared set is not
