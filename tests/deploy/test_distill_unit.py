"""Distillation pieces on small tensors: the loss, the data order, the schedule, the corpus file, the settings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from apiary.deploy import corpus
from apiary.deploy.distill import (DistillConfig, DistillError, TokenData, TokenSample, distill_loss, lr_at, sample_order,
                            step_loss, teacher_targets, tokenize, top_k_targets)


@pytest.mark.parametrize("k", [3, 11])
def test_top_k_kl_with_a_rest_bucket_is_exact(k: int) -> None:
    """Over k tokens + "the rest" the KL equals the true KL of those k + 1 outcomes; with k = vocab, the full KL."""
    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    ids, mask = torch.randint(0, 11, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    t_idx, t_logp = top_k_targets(t, k, temperature=2.0)
    loss, kl, ce = distill_loss(s, ids, mask, t_idx, t_logp, temperature=2.0, alpha_ce=0.0)

    def bucketed(logits: torch.Tensor) -> torch.Tensor:  # probabilities of the teacher's top k, then the rest
        p = F.softmax(logits / 2, -1)
        top = p.gather(-1, t_idx.long())
        return torch.cat([top, 1 - top.sum(-1, keepdim=True)], -1).clamp_min(1e-12)
    pt, ps = bucketed(t), bucketed(s)
    expected = (pt * (pt.log() - ps.log())).sum(-1).mean() * 4
    assert kl == pytest.approx(float(expected), rel=1e-4, abs=1e-6) and float(loss) == pytest.approx(kl, rel=1e-6)
    if k == 11:
        full = F.kl_div(F.log_softmax(s / 2, -1).flatten(0, 1), F.log_softmax(t / 2, -1).flatten(0, 1),
                        log_target=True, reduction="batchmean") * 4
        assert kl == pytest.approx(float(full), rel=1e-4)
    assert ce == pytest.approx(float(F.cross_entropy(s[:, :-1].flatten(0, 1), ids[:, 1:].flatten())), rel=1e-5)


def test_loss_is_zero_when_the_student_is_the_teacher_and_ignores_padding() -> None:
    torch.manual_seed(1)
    t = torch.randn(1, 6, 50)
    t_idx, t_logp = top_k_targets(t, 4, temperature=1.0)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    garbage = t.clone()
    garbage[:, 4:] = 1e4  # padded positions: whatever is there must not count
    _, kl, _ = distill_loss(garbage, torch.zeros(1, 6, dtype=torch.long), mask, t_idx, t_logp, 1.0, 0.0)
    assert abs(kl) < 1e-5  # top 4 of 50 only, yet zero: the rest bucket makes the teacher itself optimal


def test_top_k_kl_punishes_the_wrong_token() -> None:
    logits = torch.full((1, 1, 100), -10.0)
    logits[..., 7] = 10.0
    t_idx, t_logp = top_k_targets(logits, 4, temperature=1.0)
    wrong = logits.clone()
    wrong[..., 7], wrong[..., 8] = -10.0, 10.0
    args = (torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), t_idx, t_logp, 1.0, 0.0)
    assert distill_loss(logits, *args)[1] < 1e-3 < 5 < distill_loss(wrong, *args)[1]


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
    from apiary.cloud.engine.tokenizer import Tokenizer

    samples = corpus.general_samples()
    assert len(samples) >= 10 and sum(len(s.text) for s in samples) > 20_000
    assert all(s.kind == "general" and s.prompt == "" for s in samples)
    tok = Tokenizer.from_gguf_metadata(teacher_tokenizer_meta)
    data = tokenize(tok, samples[:3], seq_len=64)
    assert data.prefix == [] and len(data.samples) > 3
    assert all(isinstance(p, TokenSample) and 8 < len(p.ids) <= 64 and not p.shared for p in data.samples)

    def sensor(user: str) -> corpus.Sample:
        return corpus.Sample(kind="sensor", prompt=f"<|im_start|>system\nWatch the hives.<|im_end|>\n<|im_start|>user\n"
                             f"{user}<|im_end|>\n<|im_start|>assistant\n", completion='{"assessment": "normal"}<|im_end|>\n')
    data = tokenize(tok, [sensor("Hive 1 is warm"), sensor("Hive 2 is light"), samples[0]], seq_len=4096)
    assert tok.decode(data.prefix, skip_special_tokens=False) == "<|im_start|>system\nWatch the hives.<|im_end|>\n" \
                                                                 "<|im_start|>user\nHive "
    first = data.samples[0]
    assert first.shared and not data.samples[-1].shared and data.tail(first) == first.ids[len(data.prefix):]
    assert tok.decode(first.ids[first.answer_start + 1:], skip_special_tokens=False).startswith('{"assessment"')
    held_out = tokenize(tok, [sensor("Hive 9 is loud")], seq_len=4096, prefix=data.prefix)
    assert held_out.prefix == data.prefix and held_out.samples[0].shared
    assert tokenize(tok, [sensor("x")], seq_len=4096).prefix == []  # one sample: nothing to share


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
    from apiary.shared.prompting import SYSTEM_PROMPT

    situations = corpus.sensor_situations(6, seed=1)
    assert len(situations) == 6 and len({label for _, label in situations}) == 6
    for messages, label in situations:
        assert messages[0] == {"role": "system", "content": SYSTEM_PROMPT} and messages[1]["role"] == "user"
    assert corpus.sensor_situations(6, seed=1) == situations  # deterministic
    held_out = corpus.sensor_situations(6, seed=1 + corpus.HELD_OUT_SEED_OFFSET)
    overlap = {m[1]["content"] for m, _ in held_out} & {m[1]["content"] for m, _ in situations}
    assert len(overlap) <= 1  # other hives; an identical rounded report is possible, a shared set is not


def test_teacher_targets_over_a_shared_prefix_equal_the_full_sequences() -> None:
    from tests.deploy.conftest import tiny_model

    teacher = tiny_model(seed=2)
    prefix = [5, 6, 7, 8, 9, 10]
    samples = [TokenSample(prefix + [11, 12, 13], 7, shared=True), TokenSample(prefix + [20, 21], 7, shared=True),
               TokenSample([30, 31, 32, 33], 0)]
    data = TokenData(prefix=prefix, samples=samples)
    prefix_t, tails = teacher_targets(teacher, data, k=5, temperature=2.0, batch_size=2)
    with torch.no_grad():
        for s, (idx, val) in zip(samples, tails):
            full_idx, full_val = top_k_targets(teacher(torch.tensor([s.ids]))[0], 5, 2.0)
            if s.shared:
                assert torch.equal(prefix_t[0], full_idx[:len(prefix)])
                assert torch.allclose(prefix_t[1], full_val[:len(prefix)], atol=1e-5)
                full_val, full_idx = full_val[len(prefix):], full_idx[len(prefix):]
            assert torch.equal(idx, full_idx) and torch.allclose(val, full_val, atol=1e-5)


def test_step_loss_trains_on_tails_after_the_prefix_and_counts_the_prefix_once() -> None:
    from tests.deploy.conftest import tiny_model

    teacher, student = tiny_model(seed=2), tiny_model(seed=3)
    prefix = list(range(100, 140))
    samples = [TokenSample(prefix + [1, 2, 3, 4], 39, shared=True), TokenSample(prefix + [5, 6], 39, shared=True),
               TokenSample([7, 8, 9, 10, 11], 0)]
    data = TokenData(prefix=prefix, samples=samples)
    prefix_t, tails = teacher_targets(teacher, data, k=8, temperature=1.0)
    cfg = DistillConfig(teacher=Path(__file__), out=Path("unused"), top_k=8, temperature=1.0, alpha_ce=0.0)
    loss, kl, _, tokens = step_loss(student, data, [0, 1, 2], prefix_t, tails, cfg)
    assert tokens == 40 + 4 + 2 + 5 and kl > 0
    loss.backward()
    assert student.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    _, kl_same, _, _ = step_loss(teacher, data, [0, 1, 2], prefix_t, tails, cfg)
    assert kl_same < 1e-4  # the teacher matches itself on prefix, tails and plain samples alike


def test_sensor_situations_in_the_tuned_teachers_short_style() -> None:
    from apiary.shared.prompting import SHORT_SYSTEM_PROMPT

    situations = corpus.sensor_situations(4, seed=1, style="short")
    assert all(m[0] == {"role": "system", "content": SHORT_SYSTEM_PROMPT} and len(m) == 2 for m, _ in situations)
    assert [label for _, label in situations] == [label for _, label in corpus.sensor_situations(4, seed=1)]


def _answered(label: str, answered: str | None) -> dict:
    return {"kind": "sensor", "prompt": "p", "completion": "c", "label": label, "answered": answered}


def test_wrong_teacher_answers_are_left_out_and_counted(tmp_path: Path) -> None:
    from apiary.deploy.distill import prepare_corpus

    rows = [_answered("normal", "normal"), _answered("robbing", "swarming"), _answered("heat_stress", None)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text(json.dumps(_answered("swarming", "robbing")) + "\n")
    cfg = DistillConfig(teacher=Path(__file__), out=tmp_path, n_sensor=3, n_eval=1, n_general=0)
    info: dict = {}
    train, held_out = prepare_corpus(cfg, lambda m: None, info)  # both files complete: no teacher needed
    assert [s.label for s in train] == ["normal"] and len(held_out) == 1  # held-out samples are all kept
    assert info == {"situations": 3, "right": 1, "held_out_right": 0, "held_out": 1, "kept": 1}
    cfg.keep_wrong = True
    assert [s.label for s in prepare_corpus(cfg, lambda m: None)[0]] == ["normal", "robbing", "heat_stress"]


def test_a_corpus_is_not_continued_with_another_teacher(tmp_path: Path) -> None:
    from apiary.deploy.distill import prepare_corpus
    from apiary.shared import assets

    (tmp_path / "corpus.jsonl").write_text(json.dumps(_answered("normal", "normal")) + "\n")
    plain = DistillConfig(teacher=Path(__file__), out=tmp_path, n_sensor=1, n_eval=0, n_general=0)
    prepare_corpus(plain, lambda m: None)
    assert json.loads((tmp_path / "corpus.json").read_text())["prompt_style"] == "examples"
    tuned = DistillConfig(teacher=Path(__file__), out=tmp_path, n_sensor=1, n_eval=0, n_general=0,
                          teacher_adapter=assets.shipped("sensor-teacher-lora"))
    assert tuned.prompt_style == "short"  # the adapter's
    with pytest.raises(DistillError, match="another teacher, adapter or prompt style"):
        prepare_corpus(tuned, lambda m: None)
    with pytest.raises(DistillError, match="adapter not found"):
        DistillConfig(teacher=Path(__file__), out=tmp_path, teacher_adapter=tmp_path)


def test_the_teacher_is_the_base_with_its_adapter_merged(tmp_path: Path, teacher_tokenizer_meta: dict) -> None:
    from apiary.cloud.engine import adapter as adapter_format
    from apiary.deploy.distill import load_teacher
    from apiary.deploy.student import save_hf_folder

    from .conftest import tiny_model

    base = tiny_model(seed=3)
    save_hf_folder(base, teacher_tokenizer_meta, tmp_path / "base")
    name = "model.layers.1.self_attn.v_proj"
    w = base.state_dict()[name + ".weight"]
    a, b = torch.randn(4, w.shape[1]), torch.randn(w.shape[0], 4)
    adapter_format.write(tmp_path / "adapter", adapter_format.AdapterConfig(rank=4, alpha=8.0, targets=[name],
                                                                           prompt_style="short"),
                         {name + ".lora_A": a, name + ".lora_B": b})
    cfg = DistillConfig(teacher=tmp_path / "base", out=tmp_path / "out", teacher_adapter=tmp_path / "adapter")
    merged = load_teacher(cfg).state_dict()
    torch.testing.assert_close(merged[name + ".weight"], w + 2.0 * (b @ a))
    other = "model.layers.0.self_attn.v_proj.weight"
    torch.testing.assert_close(merged[other], base.state_dict()[other])


def test_some_situations_are_asked_with_fewer_earlier_events() -> None:
    full = corpus.sensor_situations(40, seed=3, style="short")
    cut = corpus.sensor_situations(40, seed=3, style="short", context_drop=0.5)
    assert [label for _, label in cut] == [label for _, label in full]
    changed = [(f, c) for (f, _), (c, _) in zip(full, cut) if f != c]
    # About half are cut, drawn from the seed; cuts that keep the 3 events a prompt shows change nothing.
    assert 3 <= len(changed) <= 20
    for f, c in changed:  # the same event, with another (or no) change over the last minutes
        assert f[1]["content"].splitlines()[:2] == c[1]["content"].splitlines()[:2]
        assert f[1]["content"].splitlines()[-1] == c[1]["content"].splitlines()[-1]
    assert any("Change over" not in c[1]["content"] for _, c in changed)
    assert corpus.sensor_situations(40, seed=3, style="short", context_drop=0.5) == cut  # deterministic


@pytest.mark.parametrize("flags, expected", [({"avx2", "fma"}, None), ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
                                             ({"amx_bf16"}, torch.bfloat16)])
def test_auto_autocast_is_bf16_only_where_the_cpu_computes_it(flags: set[str], expected: torch.dtype | None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Distillation and fine-tuning train in bf16 only on native bf16 (emulated, a short distillation ran past
    600 s on an AVX2 host); explicit choices stand."""
    from apiary.deploy.finetune import autocast_dtype
    from apiary.kernels import cpu

    monkeypatch.setattr(cpu, "host_flags", lambda: frozenset(flags))
    assert autocast_dtype("auto") == expected
    assert autocast_dtype("float32") is None and autocast_dtype("bfloat16") == torch.bfloat16
