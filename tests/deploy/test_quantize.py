"""INT4 GGUF export on tiny random models: llama.cpp reads exactly the model we wrote."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from apiary.cloud.engine.loader import load_checkpoint, unpermute_qk
from apiary.deploy.agreement import agreement, llama_top1, torch_top1
from apiary.deploy.quantize import QuantizeError, export_gguf, permute_qk, quantize
from apiary.deploy.student import LlamaForTraining, save_hf_folder
from tests.deploy.conftest import tiny_model


def test_permute_is_the_inverse_of_the_engines_unpermute() -> None:
    w = np.random.default_rng(0).standard_normal((3 * 2 * 8, 5)).astype(np.float32)
    for heads in (1, 3, 6):
        p = permute_qk(w, heads)
        assert not np.array_equal(p, w) and np.array_equal(unpermute_qk(p, heads), w)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, teacher_tokenizer_meta: dict) -> tuple[Path, LlamaForTraining]:
    model = tiny_model(seed=7)
    return save_hf_folder(model, teacher_tokenizer_meta, tmp_path_factory.mktemp("q") / "student"), model


@pytest.mark.timeout(300)
def test_q4_0_export_reads_back_as_the_same_model_in_the_loader_and_in_llama_cpp(
        tmp_path: Path, folder, teacher_tokenizer_meta: dict) -> None:
    import gguf
    from llama_cpp import Llama

    from apiary.cloud.engine.tokenizer import Tokenizer

    path, model = folder
    out = export_gguf(path, tmp_path / "s.gguf", "q4_0")
    back = load_checkpoint(out)
    assert back.config.num_layers == 2 and back.config.num_kv_heads == 2 and back.config.tie_word_embeddings
    assert back.metadata["tokenizer.chat_template"] == teacher_tokenizer_meta["tokenizer.chat_template"]
    assert back.metadata["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    for name, w in model.state_dict().items():  # q/k come back un-permuted, so the permutation was right
        err = float((back.weights[name] - w).norm() / w.norm())
        assert err < (0.01 if name.endswith("norm.weight") else 0.2), (name, err)

    llm = Llama(model_path=str(out), n_ctx=128, n_threads=1, verbose=False)
    assert llm.n_vocab() == 49152 and llm.metadata["llama.block_count"] == "2"
    tok = Tokenizer.from_gguf_metadata(teacher_tokenizer_meta)
    text = tok.apply_chat_template([{"role": "user", "content": "Hive 12 weighs 41.3 kg, is that a swarm?"}])
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok.encode(text)
    llm.close()
    # The same (dequantised) weights in torch and in llama.cpp: the same next token nearly everywhere.
    quantised = LlamaForTraining.from_checkpoint(back).eval()
    seqs = [tok.encode(text), [int(i) for i in np.random.default_rng(1).integers(0, 49152, 40)]]
    result = agreement(torch_top1(quantised, seqs), llama_top1(out, seqs, threads=1))
    assert result.positions == sum(map(len, seqs)) and result.rate >= 0.9, result


def test_q4_1_export_loads_in_llama_cpp(tmp_path: Path, folder) -> None:
    from llama_cpp import Llama

    path, _ = folder
    q40, q41 = export_gguf(path, tmp_path / "a.gguf", "q4_0"), export_gguf(path, tmp_path / "b.gguf", "q4_1")
    assert q40.stat().st_size < q41.stat().st_size  # Q4_1 blocks carry a minimum as well as a scale
    llm = Llama(model_path=str(q41), n_ctx=64, n_threads=1, verbose=False)
    assert llm.metadata["general.file_type"] == "3" and llm.n_vocab() == 49152
    llm.eval(llm.tokenize(b"The hive is quiet", add_bos=False))
    # the context's own last logits: with logits_all=False llama-cpp-python leaves Llama.scores unwritten
    # (uninitialised memory, which once held a NaN and failed this test)
    logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
    assert np.isfinite(logits).all() and logits.std() > 0
    llm.close()


def _metadata(path: Path) -> dict:
    import gguf

    from apiary.cloud.engine.loader import read_gguf_metadata

    return read_gguf_metadata(gguf.GGUFReader(path))


def test_the_folders_prompt_style_is_written_to_the_gguf(tmp_path: Path, folder, teacher_tokenizer_meta: dict) -> None:
    from llama_cpp import Llama

    from apiary.shared.prompting import PROMPT_STYLE_KEY

    _, model = folder
    configs = {"distill": {"apiary_distill": {"teacher": "t.gguf", "prompt_style": "short"}},
               "top-level": {"apiary_prompt_style": "short"}, "none": {"apiary_distill": {"teacher": "t.gguf"}}}
    for name, extra in configs.items():
        styled = save_hf_folder(model, teacher_tokenizer_meta, tmp_path / name, extra)
        out = export_gguf(styled, tmp_path / f"{name}.gguf")
        assert _metadata(out).get(PROMPT_STYLE_KEY) == (None if name == "none" else "short"), name
    llm = Llama(model_path=str(tmp_path / "distill.gguf"), n_ctx=64, n_threads=1, verbose=False)
    assert llm.metadata[PROMPT_STYLE_KEY] == "short"  # what the edge's LocalModel reads
    llm.close()
    assert quantize(tmp_path / "distill", tmp_path / "r.gguf", n_eval=0).prompt_style == "short"
    odd = save_hf_folder(model, teacher_tokenizer_meta, tmp_path / "odd", {"apiary_prompt_style": "verbose"})
    with pytest.raises(QuantizeError, match="prompt style 'verbose'"):
        export_gguf(odd, tmp_path / "odd.gguf")
    assert not (tmp_path / "odd.gguf").exists()


@pytest.mark.timeout(300)
def test_q5_0_embeddings_load_in_llama_cpp_and_are_measured(tmp_path: Path, folder,
                                                           teacher_tokenizer_meta: dict) -> None:
    import gguf

    from apiary.cloud.engine.tokenizer import Tokenizer

    path, _ = folder
    q8 = export_gguf(path, tmp_path / "q8.gguf", "q4_0")
    q5 = export_gguf(path, tmp_path / "q5.gguf", "q4_0", embed_qtype="q5_0")
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(q5).tensors}
    assert kinds["token_embd.weight"] == gguf.GGMLQuantizationType.Q5_0
    assert kinds["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q4_0
    assert q5.stat().st_size < q8.stat().st_size
    # llama.cpp decodes the Q5_0 embedding (and tied head) as gguf's numpy dequantiser does.
    back = LlamaForTraining.from_checkpoint(load_checkpoint(q5)).eval()
    tok = Tokenizer.from_gguf_metadata(teacher_tokenizer_meta)
    seqs = [tok.encode("The colony is calm and the frames are heavy with honey."),
            [int(i) for i in np.random.default_rng(2).integers(0, 49152, 40)]]
    result = agreement(torch_top1(back, seqs), llama_top1(q5, seqs, threads=1))
    assert result.positions == sum(map(len, seqs)) and result.rate >= 0.9, result
    # ... and apiary quantize measures it against the float32 folder like any export.
    report = quantize(path, tmp_path / "r.gguf", "q4_0", n_eval=2, threads=1, embed_qtype="q5_0")
    assert report.embed_qtype == "q5_0" and report.prompt_style is None and report.size_bytes == q5.stat().st_size
    assert report.positions > 0 and 0.0 <= report.top1_agreement <= 1.0
    with pytest.raises(QuantizeError, match="embed_qtype"):
        export_gguf(path, tmp_path / "x.gguf", embed_qtype="q4_0")


def test_bad_exports_are_refused(tmp_path: Path, folder, teacher_tokenizer_meta: dict) -> None:
    path, _ = folder
    with pytest.raises(QuantizeError, match="qtype"):
        export_gguf(path, tmp_path / "x.gguf", "q2_k")
    with pytest.raises(QuantizeError, match="cannot export"):
        export_gguf(tmp_path / "nothing", tmp_path / "x.gguf")
    plain = tmp_path / "no-tokenizer"
    plain.mkdir()
    for f in ("config.json", "model.safetensors"):
        (plain / f).write_bytes((path / f).read_bytes())
    with pytest.raises(QuantizeError, match="tokenizer_gguf.json"):
        export_gguf(plain, tmp_path / "x.gguf")
    odd = save_hf_folder(tiny_model(hidden_size=48, head_dim=12, intermediate_size=96), teacher_tokenizer_meta,
                         tmp_path / "odd")
    with pytest.raises(QuantizeError, match="block size"):
        export_gguf(odd, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
