"""A small, deterministic byte-level BPE tokenizer and Qwen3-style chat template for tiny models.

The tokenizer is trained with the `tokenizers` library on a generated English + code corpus. The
corpus comes from a fixed word list and `random.Random` with a fixed seed (stable across Python
versions), and training runs single-threaded, so the same `tokenizers` version always produces the
same tokenizer.json. Byte-level BPE covers all 256 bytes, so any UTF-8 text round-trips.

The pre-tokenizer is Qwen2's split regex + ByteLevel, without Qwen2's NFC normalizer: NFC would
break the round trip of decomposed text, and the GGUF tokenizer that transformers rebuilds from
`tokenizer.ggml.pre = "qwen2"` has no normalizer either, so both paths encode the same ids.
"""

from __future__ import annotations

import json
import os
import random
from contextlib import contextmanager

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

# Qwen2/Qwen3's pre-tokenizer split (transformers' qwen2 PRETOKENIZE_REGEX, llama.cpp "qwen2").
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE = "qwen2"

# Control tokens (special: skipped when decoding with skip_special_tokens) come first, then the
# markup tokens, which Qwen3 adds as plain (non-special) added tokens so they stay visible in text.
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP_TOKENS = [
    "<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>",
]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 4096

_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw
far sea draw left late run don't while press close night real life few north open seem together
next white children begin got walk example ease paper group always music those both mark often
letter until mile river car feet care second book carry took science eat room friend began idea
fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better
true during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power town
fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct
able pound done beauty drive stood contain front teach week final gave green quick develop ocean
warm free minute strong special mind behind clear tail produce fact street inch multiply nothing
course stay wheel full force blue object decide surface deep moon island foot system busy test
record boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape
equate miss brought heat snow tire bring yes distant fill east paint language among server cache
request response token model memory session conversation prefix page slot scheduler worker gateway
""".split()

_CODE = """
def class return import from self None True False yield async await lambda raise except finally
while elif else for in not and or with as pass break continue global print len range list dict
str int float bool tuple set open json path config args kwargs value key index result error data
function const let var null undefined this new typeof console log export default interface type
struct impl fn pub mut match enum trait use mod crate where Some Ok Err Vec String Option Result
include define ifndef endif static void char unsigned size_t return malloc free sizeof printf
SELECT FROM WHERE INSERT INTO VALUES UPDATE DELETE JOIN ORDER GROUP BY LIMIT http https localhost
""".split()

_PUNCT = [". ", ", ", "? ", "! ", "; ", ": ", " - ", " (", ") ", "\"", "'", "\n", "\n\n"]
_CODE_LINES = [
    "def {a}({b}, {c}):\n    return {b} + {c}\n",
    "for {a} in range({n}):\n    print({a})\n",
    "if {a} is None:\n    raise ValueError(\"{b}\")\n",
    "const {a} = {{ {b}: {n}, {c}: \"{b}\" }};\n",
    "fn {a}({b}: i32) -> i32 {{ {b} * {n} }}\n",
    "{{\"{a}\": {n}, \"{b}\": [\"{c}\", {n}], \"{c}\": null}}\n",
    "<tool_call>\n{{\"name\": \"{a}\", \"arguments\": {{\"{b}\": \"{c}\"}}}}\n</tool_call>\n",
    "    {a}.{b}[{n}] = {c}_{a}({n}) # {b} {c}\n",
    "SELECT {a}, {b} FROM {c} WHERE {a} > {n};\n",
]


def _ident(rng: random.Random) -> str:
    words = [rng.choice(_WORDS + _CODE).lower().strip("'") for _ in range(rng.randint(1, 2))]
    if rng.random() < 0.5:  # camelCase: whole identifiers become pre-tokens, giving more merges
        return words[0] + "".join(w.capitalize() for w in words[1:])
    return "_".join(words)


def build_corpus(num_lines: int = 6000, seed: int = 1234) -> list[str]:
    """Deterministic English-like sentences and code snippets (nonsense, but realistic bytes)."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        if i % 3 == 2:
            template = rng.choice(_CODE_LINES)
            lines.append(template.format(
                a=_ident(rng), b=_ident(rng), c=_ident(rng), n=rng.randint(0, 4096)
            ))
            continue
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.insert(rng.randint(0, len(words)), str(rng.randint(0, 10**rng.randint(1, 6))))
        lines.append(" ".join(words) + rng.choice(_PUNCT))
    return lines


@contextmanager
def _single_threaded():
    """The tokenizers library reads TOKENIZERS_PARALLELISM on each call; serial training makes
    the merge order independent of thread scheduling."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train the byte-level BPE; the added tokens take the last ids (as in Qwen's vocabularies)."""
    num_added = len(CONTROL_TOKENS) + len(MARKUP_TOKENS)
    tok = Tokenizer(models.BPE(byte_fallback=False, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_added,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    with _single_threaded():
        tok.train_from_iterator(build_corpus(), trainer=trainer)
    base = tok.get_vocab_size()
    if base != vocab_size - num_added:
        raise RuntimeError(f"corpus too small: BPE reached {base} tokens")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tok


# Qwen3-style template: Hermes tools block, <tool_call> JSON, tool results grouped into one user
# turn, and reasoning kept only for assistant turns after the last user query (as Qwen3 does).
CHAT_TEMPLATE = r"""{%- macro text(content) -%}
{%- if content is string -%}{{- content -}}
{%- elif content -%}{%- for part in content -%}{%- if part.text is defined -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- text(messages[0].content) + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- if message.role == 'user' and ns.last_query_index == messages|length - 1 %}{%- set ns.last_query_index = messages|length - 1 - loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'user' or message.role == 'system' %}
{{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.reasoning_content and loop.index0 > ns.last_query_index %}
{{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' }}
{%- endif %}
{{- text(message.content) }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if not loop.first or message.content %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""


def tokenizer_files(vocab_size: int = DEFAULT_VOCAB_SIZE) -> dict[str, bytes]:
    """tokenizer.json and tokenizer_config.json contents, byte-for-byte deterministic."""
    tok = build_tokenizer(vocab_size)
    # Re-serialize with sorted keys so the bytes do not depend on the library's map ordering.
    tokenizer_json = json.dumps(json.loads(tok.to_str()), indent=1, sort_keys=True, ensure_ascii=False)
    config = {
        # The generic fast tokenizer loads tokenizer.json as is; Qwen2Tokenizer would add NFC.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }
    return {
        "tokenizer.json": tokenizer_json.encode("utf-8"),
        "tokenizer_config.json": json.dumps(config, indent=1, sort_keys=True).encode("utf-8"),
    }


def token_ids(tok_json: bytes) -> dict[str, int]:
    """Ids of the added tokens, read back from tokenizer.json bytes."""
    data = json.loads(tok_json)
    return {t["content"]: t["id"] for t in data["added_tokens"]}
