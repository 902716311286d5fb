"""Quantized weights as people download them serve, with mlx_lm's greedy output; model aliases.

The MLX checkpoint is made by mlx-lm's own converter from the tiny qwen3 twin with its mixed
3/6-bit recipe (per-layer bits in config.json); the reference is mlx_lm's `generate_step` on
`mlx_lm.load` of the same directory, in this process. (Affine 4-bit g64, 8-bit g32 and mxfp4
checkpoints load as mlx_lm loads them: tests/integration/test_quantized_mlx.py; one group each
here would cost CI a minute for the same code path.) The GGUF twin is a Q4_K_M file (Q4_K and
Q6_K blocks); mlx_lm has no GGUF loader, so its reference is `generate_step` on the worker's own
loader's model in this process (the loader's exactness is tests/integration/test_gguf_formats.py).
The GGUF group also runs with `--served-model-name` aliases.
"""

from __future__ import annotations

import openai
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.convert import convert

from fixtures.tiny_models import generate_tiny_model
from switchyard.common.tokenizer_loading import load_tokenizer
from switchyard.testing.group import ServerGroup, stop_all
from switchyard.testing.texts import LONG_TEXT, SHORT_TEXT
from tests.e2e.test_parity import assert_same_as_reference, greedy_reference
from switchyard.worker.model_loading import load_model

MAX_TOKENS = 32
MLX_VARIANTS = {"mlx-mixed-3-6": dict(quant_predicate="mixed_3_6")}
ALIASES = ("tiny-q4", "gpt-4o-mini")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("quantized")
    paths = {}
    for name, kw in MLX_VARIANTS.items():
        convert(str(tiny_model_dir("qwen3")), str(root / name), quantize=True, **kw)
        paths[name] = root / name
    paths["gguf-q4_k_m"] = generate_tiny_model(root / "q4km.gguf", arch="qwen3", fmt="gguf",
                                               quant="Q4_K_M")
    return paths


@pytest.fixture(scope="module")
def servers(models):
    started: dict[str, ServerGroup] = {}

    def get(name: str) -> ServerGroup:
        if name not in started:
            extra = [a for alias in ALIASES for a in ("--served-model-name", alias)] \
                if name.startswith("gguf") else []
            started[name] = ServerGroup(models[name], slots=1, ctx=2048, extra=extra).start()
        return started[name]

    yield get
    stop_all(started.values())


def reference(path):
    if path.suffix == ".gguf":
        return load_model(str(path)).model, load_tokenizer(str(path))
    return mlx_load(str(path))


@pytest.mark.parametrize("name", [*MLX_VARIANTS, "gguf-q4_k_m"])
def test_quantized_model_serves_mlx_lm_greedy_output(models, servers, name):
    model, tokenizer = reference(models[name])
    group = servers(name)
    with openai.OpenAI(base_url=group.base_url, api_key="none", max_retries=0,
                       timeout=180) as client:
        model_id = client.models.list().data[0].id
        for text in (SHORT_TEXT, LONG_TEXT):
            prompt_ids = tokenizer.encode(text)
            expected = greedy_reference(model, tokenizer, prompt_ids, MAX_TOKENS)
            assert len(expected) >= 8
            reply = client.completions.create(model=model_id, prompt=prompt_ids,
                                              max_tokens=MAX_TOKENS, temperature=0)
            assert_same_as_reference(reply, tokenizer, expected, MAX_TOKENS)


def test_served_model_names_are_listed_and_accepted(servers):
    group = servers("gguf-q4_k_m")
    with openai.OpenAI(base_url=group.base_url, api_key="none", max_retries=0,
                       timeout=180) as client:
        assert [m.id for m in client.models.list().data] == list(ALIASES)
        assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
        for alias in ALIASES:
            reply = client.chat.completions.create(
                model=alias, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
            assert reply.model == ALIASES[0] and reply.usage.completion_tokens > 0
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="q4km", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4)
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("q4km")
