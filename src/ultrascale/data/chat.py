"""Chat data (`data.format: chat`): conversations rendered with the tokenizer folder's chat
template, trained on the assistant's tokens, packed whole into samples (docs/sft.md).

A conversation is a record's `data.messages_key` field: a list of {role, content} messages
(roles: system, user, assistant, tool), or ShareGPT's {from, value} (`normalise_conversation`
maps them, and joins OpenAI's content parts of text). transformers renders it with the folder's
chat template (`apply_chat_template`). Which tokens are the assistant's:
- the template's `{% generation %}` markers, where it has them: exactly the tokens
  `apply_chat_template(..., return_assistant_tokens_mask=True)` marks;
- otherwise by role: an assistant message's tokens are what rendering up to and including it adds
  to rendering up to it with the generation prompt (`add_generation_prompt=True`: the role's
  header), i.e. its content and end-of-turn tokens. A template that does not render a
  conversation's beginning as the beginning of the whole is refused (it needs markers).
`data.loss_on: assistant` trains on those tokens only, `all` on every token.

Conversations are packed whole, in order, into samples of `training.seq_len` tokens (plus one for
the last target), the rest padded; a conversation that does not fit the current sample starts the
next. Each sample records where its conversations and its padding begin (`Window.begins`, so
that `data.document_mask`, on by default for chat data, keeps attention inside each) and which of
its tokens count (`Window.counted`). A conversation longer than seq_len is refused, dropped or cut
(`data.overlong`), and counted in the run's header (`ChatStats.line`).

transformers is needed for chat data only (`pip install -e '.[chat]'`); nothing else imports it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ultrascale.data.corpus import records
from ultrascale.data.windows import NO_BEGINS, Window, micro_batch
from ultrascale.data.tokenizers import load_tokenizer

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speakers (`from`) as FastChat and LLaMA-Factory write them, to the roles templates
# take (LLaMA-Factory's function_call is the assistant calling a tool, observation the answer).
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "function_call": "assistant",
                  "observation": "tool"}
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatDataError(ValueError):
    """Chat data that cannot be trained on as it is: what is wrong, where, and the fix."""


def chat_tokenizer(spec: str):
    """The transformers tokenizer of a local folder, with its chat template (never
    downloaded)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ChatDataError("data.format=chat renders conversations with transformers' "
                            "apply_chat_template, which is not installed: pip install "
                            "transformers (or pip install -e '.[chat]').") from None
    if not Path(spec).is_dir():
        raise ChatDataError(f"data.tokenizer={spec!r} is not a folder: chat data needs a "
                            "tokenizer folder (tokenizer.json, tokenizer_config.json with its "
                            "chat template), e.g. the instruct model's own folder.")
    tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    if not getattr(tok, "chat_template", None):
        raise ChatDataError(f"data.tokenizer={spec!r} has no chat template (tokenizer_config."
                            "json's chat_template, or chat_template.jinja): give the tokenizer "
                            "folder of an instruct or chat model, or add a template to it.")
    return tok


def has_generation_markers(tok) -> bool:
    template = tok.chat_template
    templates = template.values() if isinstance(template, dict) else [template]
    return any(_GENERATION.search(t) for t in templates)


def normalise_conversation(messages, where: str):
    """The messages as chat templates take them, {role, content}: ShareGPT's {from, value}
    (FastChat, LLaMA-Factory) mapped by `SHAREGPT_ROLES`, OpenAI's content parts of text joined
    into one string (as templates that take parts render them: one after the other). An
    assistant message that only calls tools keeps its `tool_calls` and no content. Anything
    else is left as it is, for `check_conversation` to judge."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        if isinstance(m, dict) and "role" not in m and "from" in m and "value" in m:
            m = {"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m["value"]}
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = {**m, "content": _text_parts(m["content"], where)}
        out.append(m)
    return out


def _text_parts(parts: list, where: str) -> str:
    texts = []
    for part in parts:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"),
                                                                                 str):
            texts.append(part["text"])
        elif isinstance(part, str):
            texts.append(part)
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatDataError(f"{where}: a message holds a {kind!r} content part, and a text "
                                "model trains on text parts only; drop the others from the data.")
    return "".join(texts)


def _is_message(m) -> bool:
    if not isinstance(m, dict) or "role" not in m:
        return False
    if isinstance(m.get("content"), str):
        return True
    return m["role"] == "assistant" and bool(m.get("tool_calls")) and m.get("content") is None


def check_conversation(messages, where: str) -> None:
    """Refuse what is not a conversation we can train on: not a list of {role, content}, an
    unknown role, no assistant turn."""
    if not isinstance(messages, list) or not messages or not all(map(_is_message, messages)):
        raise ChatDataError(f"{where}: a conversation is a non-empty list of messages, "
                            "{\"role\": ..., \"content\": \"...\"} (OpenAI's form; content may be "
                            "a list of text parts, or absent beside an assistant's tool_calls) or "
                            "{\"from\": ..., \"value\": \"...\"} (ShareGPT's); fix the record or "
                            "data.messages_key.")
    roles = [m["role"] for m in messages]
    unknown = sorted({str(r) for r in roles if r not in ROLES})
    if unknown:
        raise ChatDataError(f"{where}: unknown role(s) {', '.join(map(repr, unknown))}; roles "
                            f"are {', '.join(ROLES)} (ShareGPT's human, gpt, function_call and "
                            "observation map to them). Rename them in the data.")
    if "assistant" not in roles:
        raise ChatDataError(f"{where}: the conversation has no assistant turn, so nothing in it "
                            "would be trained on; remove it or add the assistant's reply.")


def render(tok, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, assistant mask) of one conversation, as the module docstring says."""
    if has_generation_markers(tok):
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        return (np.asarray(out["input_ids"], dtype=np.int64),
                np.asarray(out["assistant_masks"], dtype=bool))
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _generation_prompt(tok, messages[:i])
        upto = tok.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise ChatDataError("the chat template does not render a conversation's first "
                                "messages as the beginning of the whole, so the assistant's "
                                "tokens cannot be found by role: use a template with "
                                "{% generation %} markers around the assistant's turns.")
        spans.append((len(before), len(upto)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.asarray([a for a, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    return np.asarray(enc["input_ids"], dtype=np.int64), mask


def _generation_prompt(tok, messages: list[dict]) -> str:
    """The text a template renders before an assistant's turn: the messages so far and the
    assistant's header. Before a first message some templates render nothing at all (they read
    messages[0]): then the turn begins the text."""
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001  (jinja's errors on an empty conversation vary by template)
        if messages:
            raise
        return ""


@dataclass
class ChatStats:
    """What packing did, for the run's header."""

    conversations: int = 0
    overlong: int = 0  # longer than seq_len (refused, dropped or cut: `policy`)
    emptied: int = 0  # cut to no assistant token: dropped
    policy: str = "refuse"
    by_markers: bool = True
    samples: int = 0
    loss_tokens: int = 0
    first_overlong: str = ""

    def line(self, seq_len: int, loss_on: str) -> str:
        how = "{% generation %} markers" if self.by_markers else "role"
        text = f"chat data: {self.conversations:,} conversations"
        if self.overlong:
            done = {"drop": "dropped", "cut": "cut to seq_len"}[self.policy]
            text += f", {self.overlong:,} longer than training.seq_len={seq_len} {done}"
            if self.emptied:
                text += f" ({self.emptied:,} cut to no assistant token: dropped)"
        return (text + f"; {self.samples:,} samples of {seq_len} tokens, {self.loss_tokens:,} "
                f"loss tokens ({loss_on}; the assistant's found by {how})")


@dataclass
class ChatDataset:
    """Packed conversations: samples of seq_len + 1 tokens (`Window`s)."""

    tokens: np.ndarray  # [samples, seq_len + 1]
    counted: np.ndarray  # [samples, seq_len + 1] bool: trained on as a target
    begins: list[np.ndarray]  # per sample: where conversations (and the padding) begin
    vocab_size: int
    document_mask: bool
    stats: ChatStats = field(default_factory=ChatStats)

    def __post_init__(self):
        self.seq_len = self.tokens.shape[1] - 1
        # Loss tokens per sample, as `micro_batch` makes its targets.
        self._loss = np.asarray([int((micro_batch([self.window(i)])[1] >= 0).sum())
                                 for i in range(len(self))], dtype=np.int64)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def window(self, i: int) -> Window:
        begins = self.begins[i] if self.document_mask else NO_BEGINS
        return Window(self.tokens[i].astype(np.int64), begins, self.counted[i])

    def sample(self, i: int) -> np.ndarray:
        return self.tokens[i].astype(np.int64)

    def loss_tokens(self, indices: list[int]) -> int:
        return int(self._loss[np.asarray(indices, dtype=np.int64)].sum()) if len(indices) else 0

    def split(self, fraction: float) -> tuple["ChatDataset", "ChatDataset"]:
        """(training, validation): the last ceil(fraction x samples) samples held out."""
        held = math.ceil(fraction * len(self))
        if not 1 <= held < len(self):
            raise ChatDataError(f"data.val_fraction={fraction} of {len(self)} samples leaves no "
                                "training or no validation sample; change the fraction or add "
                                "data.")
        keep = len(self) - held
        parts = [(slice(0, keep), self.begins[:keep]), (slice(keep, None), self.begins[keep:])]
        return tuple(ChatDataset(self.tokens[rows], self.counted[rows], begins, self.vocab_size,
                                 self.document_mask, self.stats) for rows, begins in parts)


def _fit(ids: np.ndarray, counted: np.ndarray, seq_len: int, stats: ChatStats, where: str):
    """The conversation as it goes into a sample (None: dropped), by `stats.policy`."""
    if len(ids) <= seq_len:
        return ids, counted
    stats.overlong += 1
    stats.first_overlong = stats.first_overlong or f"{where} ({len(ids)} tokens)"
    if stats.policy == "drop":
        return None
    ids, counted = ids[:seq_len], counted[:seq_len]
    if not counted[1:].any():
        stats.emptied += 1
        return None
    return ids, counted


def pack(conversations, seq_len: int, pad_id: int, vocab_size: int, document_mask: bool,
         stats: ChatStats) -> ChatDataset:
    """Pack (where, ids, counted) conversations whole, in order, into samples (module
    docstring)."""
    rows, masks, begins = [], [], []
    row, mask, starts = [], [], []

    def close():
        if not row:
            return
        used = sum(map(len, row))
        starts.append(used)  # the padding: its own document, never counted
        pad = seq_len + 1 - used
        rows.append(np.concatenate(row + [np.full(pad, pad_id, dtype=np.int64)]))
        masks.append(np.concatenate(mask + [np.zeros(pad, dtype=bool)]))
        begins.append(np.asarray(starts[1:], dtype=np.int64))  # 0 begins one by itself

    for where, ids, counted in conversations:
        fitted = _fit(ids, counted, seq_len, stats, where)
        if fitted is None:
            continue
        if sum(map(len, row)) + len(fitted[0]) > seq_len:
            close()
            row, mask, starts = [], [], []
        starts.append(sum(map(len, row)))
        row.append(fitted[0])
        mask.append(fitted[1])
    close()
    if stats.overlong and stats.policy == "refuse":
        raise ChatDataError(
            f"{stats.overlong:,} conversation(s) are longer than training.seq_len={seq_len} "
            f"tokens, the first {stats.first_overlong}. Set data.overlong=drop (leave them out) "
            "or data.overlong=cut (train on their first seq_len tokens), or a longer "
            "training.seq_len.")
    if not rows:
        raise ChatDataError("no conversation is left to train on (every one was dropped); see "
                            "data.overlong and training.seq_len.")
    tokens = np.stack(rows)
    if int(tokens.max()) >= vocab_size:
        raise ChatDataError(f"the chat data holds token id {int(tokens.max())}, beyond the "
                            f"tokenizer's {vocab_size}; check data.tokenizer.")
    return ChatDataset(tokens, np.stack(masks), begins, vocab_size, document_mask, stats)


def _rendered(source: str, data, tok, stats: ChatStats):
    """(where, ids, counted) of every conversation of a source."""
    for where, messages in records(source, data.messages_key):
        messages = normalise_conversation(messages, where)
        check_conversation(messages, where)
        ids, assistant = render(tok, messages)
        counted = assistant if data.loss_on == "assistant" else np.ones(len(ids), dtype=bool)
        stats.conversations += 1
        yield where, ids, counted


def load_chat(source: str, data, seq_len: int, tok=None) -> ChatDataset:
    """Render, check and pack the conversations of `source` (`data`: the config's section)."""
    tok = tok or chat_tokenizer(data.tokenizer)
    stats = ChatStats(policy=data.overlong, by_markers=has_generation_markers(tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    dataset = pack(_rendered(source, data, tok, stats), seq_len, pad, len(tok),
                   bool(data.document_mask), stats)
    stats.samples = len(dataset)
    stats.loss_tokens = dataset.loss_tokens(list(range(len(dataset))))
    return dataset


def load_chat_splits(data, seq_len: int, model_vocab: int):
    """(training, validation or None, tokenizer for decoding samples) of chat data."""
    tok = chat_tokenizer(data.tokenizer)
    if len(tok) > model_vocab:
        raise ChatDataError(f"the tokenizer has {len(tok)} tokens but model.vocab_size="
                            f"{model_vocab}; set model.vocab_size to at least {len(tok)}.")
    train = load_chat(data.source, data, seq_len, tok)
    val = None
    if data.val_source is not None:
        val = load_chat(data.val_source, data, seq_len, tok)
    elif data.val_fraction:
        train, val = train.split(data.val_fraction)
    return train, val, load_tokenizer(data.tokenizer)
