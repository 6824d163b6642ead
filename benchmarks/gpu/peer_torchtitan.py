"""torchtitan 0.3's 1B step as a peer (guarded): run where it can, skipped with the reason where it
cannot (it is not in the GPU image, wants a torch at least as new as its release's, and reads its
tokenizer and data from files).

    python benchmarks/gpu/peer_torchtitan.py --json OUT [--wheels .whl] [--smoke]

1. With `--wheels DIR`, its wheels (benchmarks/gpu/README.md says which and how to fetch them)
   are installed into a private folder that only this run puts on its path.
2. A WordLevel tokenizer of 128256 tokens (`tokenizers`) and a local JSON-lines dataset of random
   words are written to a temporary folder; each document is exactly two sequences long, so
   torchtitan's per-document mask is the causal one and every sample is whole.
3. `torchrun --standalone --nproc_per_node 1 -m torchtitan.train --module tt_peer --config
   llama3_1b_peer` (tt_peer/config_registry.py) runs 16 steps, logging every step; its tokens/s
   (`tps`, per device) and MFU are read from the log, steps 1-5 dropped, the median of the rest,
   and the MFU recomputed by our formula from the tokens/s.
`--smoke` writes tiny assets and checks that torchtitan imports (it never runs on a CPU here).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB, SEQ, BATCH, STEPS, DROP = 128256, 2048, 4, 16, 5
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def write_assets(folder: Path, vocab: int, seq: int, documents: int) -> tuple[Path, Path]:
    """(tokenizer folder, dataset folder): a WordLevel vocabulary w0.. with bos and eos, and
    `documents` documents of 2 * seq - 1 words (with bos and eos: two whole samples each)."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers

    assets, data = folder / "tokenizer", folder / "data"
    assets.mkdir(parents=True, exist_ok=True)
    data.mkdir(parents=True, exist_ok=True)
    words = {f"w{i}": i for i in range(vocab - 2)}
    words.update({BOS: vocab - 2, EOS: vocab - 1})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([BOS, EOS])
    tok.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    rng = random.Random(0)
    with open(data / "train.jsonl", "w") as f:
        for _ in range(documents):
            text = " ".join(f"w{rng.randrange(vocab - 2)}" for _ in range(2 * seq - 1))
            f.write(json.dumps({"text": text}) + "\n")
    return assets, data


def install(wheels: Path, target: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--target", str(target)] + sorted(map(str,
                                                                         wheels.glob("*.whl"))),
                   check=True, capture_output=True, text=True, timeout=120)


def run(smoke: bool, wheels: str | None, log_path: Path | None, timeout: float) -> dict:
    work = Path(tempfile.mkdtemp(prefix="tt-peer-"))
    env = dict(os.environ)
    path = [str(HERE)]
    if wheels:
        try:
            install(Path(wheels), work / "site")
        except subprocess.CalledProcessError as exc:
            return {"available": False,
                    "reason": f"its wheels did not install: {exc.stderr[-400:]}"}
        path.insert(0, str(work / "site"))
    env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")])
    probe = subprocess.run([sys.executable, "-c",
                            "import torchtitan.train, tt_peer.config_registry"],
                           env=env, capture_output=True, text=True, timeout=120)
    vocab, seq = (64, 16) if smoke else (VOCAB, SEQ)
    assets, data = write_assets(work, vocab, seq, documents=8 if smoke else 64)
    if probe.returncode != 0:
        return {"available": False, "reason": "torchtitan does not import here (carry its wheels: "
                "benchmarks/gpu/README.md): " + probe.stderr.strip().splitlines()[-1][:300]}
    if smoke:
        return {"available": False, "reason": "smoke: torchtitan imports; it runs on GPUs only"}
    env.update(TT_PEER_ASSETS=str(assets), TT_PEER_DATA=str(data), TT_PEER_STEPS=str(STEPS),
               TT_PEER_SEQ=str(SEQ), TT_PEER_BATCH=str(BATCH))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           "-m", "torchtitan.train", "--module", "tt_peer", "--config", "llama3_1b_peer"]
    try:
        proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True,
                              timeout=timeout)
        log, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        log, code = f"{exc.stdout or ''}{exc.stderr or ''}\n[timed out after {timeout:.0f} s]", -1
    if isinstance(log, bytes):
        log = log.decode(errors="replace")
    if log_path is not None:
        log_path.write_text("\n".join(log.splitlines()[-200:]) + "\n")
    return read_log(log, code)


def read_log(log: str, code: int) -> dict:
    """tokens/s and MFU of the steps after the first DROP, from torchtitan's step lines."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)
    steps = {}
    for m in re.finditer(r"step:\s*(\d+).*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%", plain):
        steps[int(m.group(1))] = (float(m.group(2).replace(",", "")), float(m.group(3)) / 100)
    steady = [v for s, v in sorted(steps.items()) if s > DROP]
    if code != 0 or not steady:
        tail = " | ".join(plain.strip().splitlines()[-3:])[-500:]
        return {"available": False, "reason": f"torchtitan exited {code}: {tail}"}
    tps = statistics.median(t for t, _ in steady)
    out = {"available": True, "peer": "torchtitan", "tokens_per_s": tps,
           "torchtitan_mfu": statistics.median(m for _, m in steady), "steps_read": len(steady)}
    try:
        from peer_hf import _bf16_peak, flops_per_token  # the same formula as ours

        shape = dict(vocab_size=VOCAB, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8)
        peak = _bf16_peak()
        out["mfu"] = tps * flops_per_token(shape, SEQ) / peak if peak else None
    except ImportError:
        out["mfu"] = None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--wheels", default=None, help="a folder of wheels to install privately")
    ap.add_argument("--log", default=None, help="where the last 200 lines of its log go")
    ap.add_argument("--timeout", type=float, default=150.0)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    result = run(args.smoke, args.wheels, Path(args.log) if args.log else None, args.timeout)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
