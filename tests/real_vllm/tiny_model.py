"""A tiny Llama-architecture model directory, built at test time: nothing is downloaded.

`vllm serve DIR --load-format dummy` fills random weights but still reads `config.json` and a
tokenizer from DIR. The tokenizer is a byte-level BPE trained with the `tokenizers` library on the
Python standard library's own sources (always on the machine), so any text, CJK included, encodes;
its chat template is a ChatML-style Jinja template with tools, tool calls and a BOS token, written
into `tokenizer_config.json` as Hugging Face models ship it. The gateway counts prompt tokens from
the same files, which is what the real-vLLM tests compare against the engine's `usage`.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL_TOKENS = [BOS, EOS, "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 2048

# Renders tools with `tojson` (as Qwen's and Llama's templates do), tool calls field by field, and
# loops over content parts, so vLLM's content-format detection picks "openai" and parts reach the
# template as dicts.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}<|im_start|>system\n# Tools\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{ part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}\n<tool_call>"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>'
    "{%- endfor %}{%- endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def corpus(max_bytes: int = 500_000, *, recursive: bool = False, skip: int = 0) -> Iterator[str]:
    """Python stdlib sources, in a fixed order, up to `max_bytes` (a deterministic vocabulary). Half a
    megabyte already fills the 2,048-token vocabulary; 3 MB cost six times the training time (about a
    second of CPU in every pytest worker that builds the model) for the same vocabulary size.
    `recursive`: the packages' sources too (a larger vocabulary needs more text); `skip` files first."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py") if recursive else root.glob("*.py"))[skip:]:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        total += len(text)
        yield text
        if total >= max_bytes:
            return


def train_tokenizer(vocab_size: int = VOCAB_SIZE, *, corpus_bytes: int = 500_000, recursive: bool = False) -> Tokenizer:
    """A byte-level BPE with ChatML's added tokens and a BOS post-processor, trained on `corpus`
    (bench/overhead/tokenize_cost.py trains a larger one the same way)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(corpus_bytes, recursive=recursive), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def build(directory: Path, *, max_position_embeddings: int = 4096) -> Path:
    """Write config.json, tokenizer.json, tokenizer_config.json into `directory` (created)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": tokenizer.token_to_id(EOS),
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return directory


if __name__ == "__main__":
    import sys

    print(build(Path(sys.argv[1])))
