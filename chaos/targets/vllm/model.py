"""Build the tiny Llama the vLLM pair serves: no hub is reachable, so it is made here, deterministically.

Run with the vLLM venv's python (it has torch, transformers and tokenizers, not pdchaos's deps):
    .venv-vllm/bin/python chaos/targets/vllm/model.py OUT_DIR

A byte-level BPE (vocab 2048) trained on this Python's own stdlib sources, and a 2-layer Llama with
random weights (seed 0, bf16). head_dim is 32 because vLLM's CPU attention supports nothing
smaller (docs/telltale-model.md). Its output is gibberish, but greedy and repeatable, which is all the
suite needs: canary markers are found by scanning text, not by the model understanding it.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

VOCAB_SIZE = 2048
TRAINING_FILES = 300
SPECIALS = ["<s>", "</s>", "<pad>"]
# A chat template with no model-specific markup: the roles in brackets, then the content.
CHAT_TEMPLATE = (
    "{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def training_files() -> list[str]:
    """The first stdlib modules in sorted order: the same list on every run of this Python."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    return [str(p) for p in files[:TRAINING_FILES]]


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train(training_files(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def build_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: model.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    build_model(out)
    print(f"tiny model written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
