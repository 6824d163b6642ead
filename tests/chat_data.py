"""Chat data made locally for the tests (nothing downloaded): a tokenizer folder built with
`tokenizers` (a word-level vocabulary with ChatML's special tokens) and a chat template with or
without `{% generation %}` markers, and JSON lines of conversations of uneven lengths."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the a of to in and is it that for on with as was by at be this from or hello there "
         "how are you fine thanks weather nice today what why when who yes no maybe").split()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ROLES = ["system", "user", "assistant", "tool"]

# ChatML, as Qwen and SmolLM write it; the assistant's content and end-of-turn inside markers.
MARKED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>"
          "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN = MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def tokenizer_folder(path: Path, template: str | None = MARKED) -> Path:
    """A Hugging Face tokenizer folder: tokenizer.json (word level, whitespace split) and
    tokenizer_config.json (its special tokens and, unless None, `template`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIALS + ["[UNK]"] + ROLES + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": "[UNK]"}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def conversation(rng: random.Random, turns: int) -> list[dict]:
    def say(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    messages = [{"role": "system", "content": say(1, 4)}] if rng.random() < 0.5 else []
    for _ in range(turns):
        messages += [{"role": "user", "content": say(1, 8)},
                     {"role": "assistant", "content": say(1, 12)}]
    return messages


def conversations_file(path: Path, count: int = 120, seed: int = 0,
                       extra: list[list[dict]] = ()) -> Path:
    """`count` conversations of 1-3 turns (uneven lengths), then `extra` ones, as JSON lines."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(count):
            f.write(json.dumps({"messages": conversation(rng, rng.randint(1, 3))}) + "\n")
        for messages in extra:
            f.write(json.dumps({"messages": messages}) + "\n")
    return path
