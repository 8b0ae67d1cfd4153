"""Tokenizer from the checkpoint: tokenizer.json, or a GGUF's gpt2-BPE vocab + merges rebuilt with `tokenizers`.

The GGUF path reproduces llama.cpp's tokenization: the same pre-tokenizer split for the
vocabulary's ``tokenizer.ggml.pre`` type, control tokens parsed as special tokens in text,
and llama.cpp's add-BOS flag. Chat requests are rendered with the checkpoint's Jinja chat
template (ChatML when the checkpoint has none).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from apiary.cloud.engine.errors import EngineError, RequestRejected

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# llama.cpp's pre-tokenizer regexes, by GGUF ``tokenizer.ggml.pre`` (see llama-vocab.cpp).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_SPLITS: dict[str, list[str]] = {
    **{name: [GPT2_SPLIT] for name in ("default", "gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "olmo")},
    **{name: [r"\p{N}", GPT2_SPLIT] for name in ("smollm", "starcoder", "refact", "command-r", "codeshell",
                                                   "exaone", "minerva-7b")},
    **{name: [LLAMA3_SPLIT] for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe")},
    **{name: [QWEN2_SPLIT] for name in ("qwen2", "qwen2.5", "qwen-2.5", "deepseek-r1-qwen")},
}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


class Tokenizer:
    def __init__(self, backend: Any, *, bos_token_id: int | None, eos_token_id: int | None, add_bos: bool,
                 chat_template: str | None, stop_token_ids: set[int] | None = None) -> None:
        self._tok = backend  # a tokenizers.Tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template or CHATML_TEMPLATE
        # End-of-generation ids: eos plus end-of-turn tokens (llama.cpp's "eog" set).
        self.stop_token_ids = set(stop_token_ids or ()) | ({eos_token_id} if eos_token_id is not None else set())
        self._template: Any = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids, special tokens in ``text`` parsed as such, BOS added when the model wants one."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_piece(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise RequestRejected("messages must be a non-empty list of {'role': str, 'content': str} dicts")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise RequestRejected(f"chat template: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        special = {name: self._tok.id_to_token(i) if i is not None else ""
                   for name, i in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id))}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **special)
        except RequestRejected:
            raise
        except Exception as e:
            raise RequestRejected(f"chat template failed on these messages: {e}") from e

    # ------------------------------------------------------------ construction

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise EngineError(f"GGUF tokenizer model {kind!r} is not supported (only gpt2 BPE); "
                              "use a Hugging Face folder with tokenizer.json for this model")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_SPLITS:
            raise EngineError(f"GGUF pre-tokenizer {pre!r} is not supported (known: {sorted(PRE_SPLITS)})")
        backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                         ignore_merges=False, fuse_unk=False, byte_fallback=False))
        splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in PRE_SPLITS[pre]]
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL])
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                            for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eog = {i for i, t in enumerate(tokens) if t in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>", "<|eom_id|>")
               and types[i] == TOKEN_TYPE_CONTROL}
        eot = meta.get("tokenizer.ggml.eot_token_id")
        return cls(backend, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=eos,
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=meta.get("tokenizer.chat_template"),
                   stop_token_ids=eog | ({eot} if eot is not None else set()))

    @classmethod
    def from_folder(cls, path: Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        file = path / "tokenizer.json"
        if not file.is_file():
            raise EngineError(f"{path} has no tokenizer.json")
        backend = HFTokenizer.from_file(str(file))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        eos = token_id(cfg.get("eos_token"))
        gen_eos = gen.get("eos_token_id")
        extra = set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else [])
        if eos is None and extra:
            eos = min(extra)
        bos = token_id(cfg.get("bos_token"))
        # A post-processor that adds BOS (Llama 3's TemplateProcessing) means prompts start with BOS.
        add_bos = bool(cfg.get("add_bos_token", False)) or (
            bos is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos])
        return cls(backend, bos_token_id=bos, eos_token_id=eos, add_bos=add_bos,
                   chat_template=cfg.get("chat_template") if isinstance(cfg.get("chat_template"), str) else None,
                   stop_token_ids=extra)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EngineError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def load_tokenizer(path: Path, gguf_metadata: dict[str, Any] | None) -> Tokenizer:
    if gguf_metadata is not None and not path.is_dir():
        return Tokenizer.from_gguf_metadata(gguf_metadata)
    return Tokenizer.from_folder(path)
