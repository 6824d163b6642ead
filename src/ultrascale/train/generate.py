"""A short text sample from a trained model: top-k sampling, no KV cache (the models we sample
here are small; clarity beats speed). The same weights, seed and prompt give the same text, so
that checkpoints of any layout sample alike (`ultrascale generate`)."""

from __future__ import annotations

import torch


@torch.no_grad()
def generate(model, tokenizer, prompt: str, max_new_tokens: int, context: int, seed: int,
             temperature: float = 0.8, top_k: int = 20) -> str:
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = tokenizer.prompt(prompt)  # BOS first where the tokenizer begins documents with one
    eos = getattr(tokenizer, "eos_id", None)
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-context:]], device=device)
        logits = model(window)[0, -1].float().cpu() / temperature
        top = torch.topk(logits, min(top_k, logits.numel()))
        probs = torch.softmax(top.values, dim=-1)
        ids.append(int(top.indices[torch.multinomial(probs, 1, generator=gen)]))
        if ids[-1] == eos:  # the document ended
            break
    return tokenizer.decode(ids)
