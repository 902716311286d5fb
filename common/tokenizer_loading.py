"""The model's tokenizer: mlx_lm's TokenizerWrapper for a model directory, repo id or .gguf file.

The gateway tokenizes and detokenizes with it; the worker builds its grammar engine's vocabulary
from it (structured outputs). MLX and transformers are imported only when a tokenizer is loaded.

For a GGUF file only the metadata is read (common.gguf_file memory-maps the file and leaves the
tensors alone), then transformers rebuilds the tokenizer from llama.cpp's vocabulary and merges.
transformers' own `from_pretrained(gguf_file=...)` imports torch, which is not installed, so the
torch-free pieces are called directly. The result is saved as a temporary tokenizer directory and
loaded with mlx_lm's loader, so a GGUF file gets exactly the same detokenizer, tool parser and
thinking-tag handling as a model directory.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

# llama.cpp's GGUF keys -> the names transformers' convert_gguf_tokenizer expects.
_GGUF_KEYS = {
    "tokenizer.ggml.model": "tokenizer_type",
    "tokenizer.ggml.pre": "pre_tokenizer_type",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type",
    "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.eot_token_id": "eot_token_id",
    "tokenizer.ggml.eom_token_id": "eom_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_bos_token": "add_bos_token",
    "tokenizer.ggml.add_eos_token": "add_eos_token",
    "tokenizer.chat_template": "chat_template",
    "general.architecture": "architecture",
}
# Control tokens that end generation although the file does not say so; llama.cpp applies the
# same rule (llama-vocab.cpp), and HF repos list them in generation_config.json's eos_token_id.
_END_OF_GENERATION = {
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
    "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>",
}
_CONTROL = 3  # llama.cpp token type


class TokenizerLoadError(Exception):
    """The tokenizer of the given model reference cannot be loaded."""


def load_tokenizer(ref: str) -> "TokenizerWrapper":
    """A TokenizerWrapper for an MLX/HF directory, a Hugging Face repo id or a .gguf file."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    path = Path(ref).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TokenizerLoadError(f"GGUF file {ref!r} does not exist")
        return _load_gguf_tokenizer(path)
    eos = _generation_eos(path) if path.is_dir() else None
    try:
        return mlx_load_tokenizer(path if path.exists() else ref, eos_token_ids=eos)
    except Exception as e:  # transformers and the hub raise many types
        raise TokenizerLoadError(f"cannot load a tokenizer from {ref!r}: {e}") from e


def _generation_eos(path: Path) -> list[int] | None:
    """eos ids as mlx_lm.utils.load passes them: config.json's, overridden by
    generation_config.json's (which often lists several, e.g. <|im_end|> and <|endoftext|>)."""
    eos = None
    for name in ("config.json", "generation_config.json"):
        try:
            eos = json.loads((path / name).read_text()).get("eos_token_id") or eos
        except (OSError, ValueError):
            pass
    return [eos] if isinstance(eos, int) else eos


def read_gguf_tokenizer_metadata(path: Path) -> dict:
    """The tokenizer metadata of a GGUF file, keyed as transformers' GGUF code names it."""
    from switchyard.common.gguf_file import GGUFFile, GGUFFormatError

    try:
        metadata = GGUFFile(path).metadata
    except (GGUFFormatError, UnicodeDecodeError) as e:
        raise TokenizerLoadError(f"{path}: not a readable GGUF file ({e})") from e
    out = {name: metadata[key] for key, name in _GGUF_KEYS.items() if key in metadata}
    if "tokens" not in out:
        raise TokenizerLoadError(f"{path}: the GGUF file has no tokenizer metadata")
    return out


def _load_gguf_tokenizer(path: Path) -> "TokenizerWrapper":
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    with tempfile.TemporaryDirectory(prefix="switchyard-tok-") as tmp:
        eos = save_gguf_tokenizer(path, Path(tmp))
        return mlx_load_tokenizer(Path(tmp), eos_token_ids=eos)


def save_gguf_tokenizer(path: Path, out_dir: Path) -> list[int]:
    """Write a GGUF file's tokenizer as a Hugging Face tokenizer directory (tokenizer.json,
    tokenizer_config.json with the chat template) into `out_dir`; returns the ids that end
    generation (what a directory lists in generation_config.json's eos_token_id)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    meta = read_gguf_tokenizer_metadata(path)
    try:
        backend, _ = convert_gguf_tokenizer(meta.get("architecture", ""), meta)
    except ValueError as e:  # unsupported tokenizer.ggml.model
        raise TokenizerLoadError(f"{path}: {e}") from e
    tokens = meta["tokens"]
    token_of = lambda key: tokens[meta[key]] if key in meta else None  # noqa: E731
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token_of("bos_token_id") if meta.get("add_bos_token") else None,
        eos_token=token_of("eos_token_id"),
        pad_token=token_of("pad_token_id"),
        unk_token=token_of("unk_token_id"),
        chat_template=meta.get("chat_template"),
        add_bos_token=bool(meta.get("add_bos_token", False)),
        add_eos_token=bool(meta.get("add_eos_token", False)),
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
    return _gguf_eos_ids(meta)


def _gguf_eos_ids(meta: dict) -> list[int]:
    ids = {meta[k] for k in ("eos_token_id", "eot_token_id", "eom_token_id") if k in meta}
    types = meta.get("token_type") or []
    for i, (token, kind) in enumerate(zip(meta["tokens"], types)):
        if kind == _CONTROL and token in _END_OF_GENERATION:
            ids.add(i)
    return sorted(ids)
