"""Tokenizer: same ids as llama.cpp on the real vocabulary, chat templates, incremental detokenization."""
from __future__ import annotations

from pathlib import Path

import pytest

from apiary.cloud.engine import LLMEngine, RequestRejected
from apiary.cloud.engine.tokenizer import Tokenizer

CORPUS = [
    "Hello world",
    " leading space and  double  spaces   ",
    "Hive 7: temp=34.6C, humidity 61%, weight 41.25kg (+0.80kg/24h)",
    "1234567890 12 345 6789 3.14159 1e-5 -42",
    "Numbers like 2024-05-17T12:30:00Z and 0xDEADBEEF",
    "tabs\tand\nnewlines\n\n\nand\r\nwindows lines",
    "   \n  indented\n    code():\n        return {'a': [1, 2]}\n",
    "Émigré café naïve façade — “quotes” ‘single’ … ellipsis",
    "日本語のテキスト、ミツバチ。中文：蜜蜂在采蜜。한국어 꿀벌",
    "emoji 🐝🍯🌻 and flags 🇫🇷 and ZWJ 👩‍🌾",
    "don't won't it's we're they've I'm you'll he'd DON'T",
    "<|im_start|>system\nYou are SmolLM.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special tokens inline: <|endoftext|> then text",
    "Ünïcödé mixed ΑΒΓ δεζ Кириллица العربية עברית हिन्दी",
    "a" * 100 + " " + "ab" * 40,
    "!!!??? ... --- *** ### @@@ $$$ %%% ^^^ &&& ((( ))) [[[ ]]]",
    "",
    " ",
    "\n",
    "URL https://example.org/path?q=1&x=%20y#frag and email bee@hive.io",
]


@pytest.fixture(scope="module")
def gguf_tokenizer(real_engine: LLMEngine) -> Tokenizer:
    """The tokenizer the engine rebuilt from the GGUF vocabulary and merges."""
    return real_engine.tokenizer


@pytest.mark.slow
def test_gguf_tokenizer_matches_llama_cpp(gguf_tokenizer: Tokenizer, gguf_path: Path) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf_path), vocab_only=True, verbose=False)
    try:
        for text in CORPUS:
            expected = llm.tokenize(text.encode(), add_bos=llm.metadata.get("tokenizer.ggml.add_bos_token") == "true",
                                    special=True)
            assert gguf_tokenizer.encode(text) == expected, text
            # And decoding gives the text back (special tokens kept), as llama.cpp does.
            assert gguf_tokenizer.decode(expected, skip_special_tokens=False) == text
    finally:
        llm.close()


def test_chat_template_renders_chatml(gguf_tokenizer: Tokenizer) -> None:
    text = gguf_tokenizer.apply_chat_template([{"role": "user", "content": "How warm is hive 3?"}])
    assert text.endswith("<|im_start|>user\nHow warm is hive 3?<|im_end|>\n<|im_start|>assistant\n")
    ids = gguf_tokenizer.encode(text)
    assert ids.count(gguf_tokenizer._tok.token_to_id("<|im_start|>")) == text.count("<|im_start|>")
    assert gguf_tokenizer.eos_token_id in gguf_tokenizer.stop_token_ids
    for bad in ([], [{"role": "user"}], "hello", [{"role": "user", "content": 3}]):
        with pytest.raises(RequestRejected):
            gguf_tokenizer.apply_chat_template(bad)  # type: ignore[arg-type]


def test_unsupported_gguf_vocabulary_is_a_clear_error() -> None:
    from apiary.cloud.engine.errors import EngineError

    with pytest.raises(EngineError, match="only gpt2 BPE"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(EngineError, match="pre-tokenizer"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"],
                                      "tokenizer.ggml.pre": "no-such-pre"})


@pytest.mark.parametrize("stop", [[], ["蜂在"], ["🐝🍯", "zz"]])
def test_incremental_detokenization_matches_full_decode(tiny_llama: Path, stop: list[str]) -> None:
    from apiary.cloud.engine import SamplingParams
    from apiary.cloud.engine import detokenizer
    from tests.cloud.engine.helpers import make_seq

    tok = Tokenizer.from_folder(tiny_llama)
    text = "Bienen 🐝🍯 sammeln. 中文：蜜蜂在采蜜。한국어 꿀벌 ミツバチ"
    ids = tok.encode(text)
    seq = make_seq(tok.encode("Report: "))
    seq.params = SamplingParams(stop=stop)
    detokenizer.start(seq)
    deltas = []
    for i, token in enumerate(ids):
        seq.token_ids.append(token)
        final = i == len(ids) - 1
        searched_from = len(seq.text)
        detokenizer.update_text(tok, seq, final=final)
        if stop and detokenizer.find_stop(seq, searched_from):
            final = True
        deltas.append(detokenizer.release(seq, final=final))
        assert "\ufffd" not in deltas[-1]  # never a half character
        if final:
            break
    expected = tok.decode(ids)
    cut = min((expected.find(s) for s in stop if s in expected), default=len(expected))
    assert "".join(deltas) == expected[:cut]
