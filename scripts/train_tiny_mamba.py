#!/usr/bin/env python
"""Train the tiny Mamba that ships in ``vllm_mamba/model_zoo/tiny-stdlib``.

Reproducible end to end: fixed seed, a sorted file list, a fixed number of steps and every
hyper-parameter is an argparse default. Run from the repository root:

    python scripts/train_tiny_mamba.py

Data: the ``*.py`` files of the Python standard library of the running interpreter
(``sysconfig.get_paths()["stdlib"]``), sorted by relative path, with test directories and
``site-packages`` excluded, and without generated or table-like data: the ``encodings`` (codec
tables) and ``pydoc_data`` (one huge string) packages are skipped, as is any file of at least
``LITERAL_MIN_CHARS`` characters in which more than ``LITERAL_MAX_FRAC`` of the non-blank,
non-comment lines start with a string or number literal (``html/entities.py``, ``locale.py``,
``stringprep.py``, ``_sysconfigdata_*.py``, ...). Every ``--holdout-every``-th file
(index % N == N - 1) is held out.

The weights are trained through a small PyTorch re-implementation of the transformers
``MambaForCausalLM`` forward whose selective scan is a custom autograd function (a sequential
in-place recurrence with a hand-written backward). That is much faster on a CPU than the
transformers reference path and uses the very same parameters; at the end the saved checkpoint
is reloaded with ``transformers.MambaForCausalLM`` and its loss on held-out windows is checked
against the training forward.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

EOT = "<|endoftext|>"
EXCLUDED_DIRS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "__pycache__",
    "encodings",
    "pydoc_data",
}
# A file this large whose code lines are mostly literals is a data table, not code.
LITERAL_MIN_CHARS = 4000
LITERAL_MAX_FRAC = 0.4
_LITERAL_LINE = re.compile(r"""^\s*([rRbBuUfF]{0,2}['"]|[-+]?\.?\d)""")
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "vllm_mamba" / "model_zoo" / "tiny-stdlib"
PROMPTS = ["def ", "import ", "class "]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--holdout-every", type=int, default=20)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--state-size", type=int, default=16)
    p.add_argument("--conv-kernel", type=int, default=4)
    p.add_argument("--expand", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=850)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=48)
    p.add_argument("--sample-tokens", type=int, default=64)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data


def list_stdlib_files() -> tuple[Path, list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        rels.append(rel.as_posix())
    return root, sorted(rels)


def literal_fraction(text: str) -> float:
    """Fraction of non-blank, non-comment lines that start with a string or number literal."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return sum(bool(_LITERAL_LINE.match(ln)) for ln in lines) / max(1, len(lines))


def is_data_file(text: str) -> bool:
    return len(text) >= LITERAL_MIN_CHARS and literal_fraction(text) > LITERAL_MAX_FRAC


def read_texts(root: Path, rels: list[str]) -> tuple[list[str], list[str], list[str]]:
    kept, texts, data_files = [], [], []
    for rel in rels:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        if is_data_file(text):
            data_files.append(rel)
            continue
        kept.append(rel)
        texts.append(text)
    return kept, texts, data_files


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok, texts: list[str], eot_id: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------- fast forward


class _SelectiveScan(torch.autograd.Function):
    """Time-major selective scan: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t, y_t = <h_t, C_t>.

    x, dt: (L, B, D); A: (D, N); Bm, Cm: (L, B, N). Returns y: (L, B, D).
    """

    @staticmethod
    def forward(ctx, x, dt, A, Bm, Cm):
        L, bsz, D = x.shape
        N = A.shape[1]
        dA = torch.exp(dt.unsqueeze(-1) * A)
        U = (dt * x).unsqueeze(-1) * Bm.unsqueeze(2)
        H = torch.empty_like(U)
        h = torch.zeros(bsz, D, N, dtype=x.dtype)
        for t in range(L):
            h = torch.addcmul(U[t], dA[t], h, out=H[t])
        y = torch.matmul(H.view(L * bsz, D, N), Cm.reshape(L * bsz, N, 1)).view(L, bsz, D)
        ctx.save_for_backward(x, dt, A, Bm, Cm, dA, H)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, dt, A, Bm, Cm, dA, H = ctx.saved_tensors
        L, bsz, D = x.shape
        N = A.shape[1]
        LB = L * bsz
        gy = gy.contiguous()
        # G_t = dLoss/dh_t = gy_t C_t + dA_{t+1} G_{t+1}
        G = torch.matmul(gy.view(LB, D, 1), Cm.reshape(LB, 1, N)).view(L, bsz, D, N)
        for t in range(L - 2, -1, -1):
            G[t].addcmul_(dA[t + 1], G[t + 1])
        gC = torch.matmul(gy.view(LB, 1, D), H.view(LB, D, N)).view(L, bsz, N)
        GB = torch.matmul(G.view(LB, D, N), Bm.reshape(LB, N, 1)).view(L, bsz, D)
        gx = GB * dt
        gdt = GB * x
        gB = torch.matmul((dt * x).view(LB, 1, D), G.view(LB, D, N)).view(L, bsz, N)
        # P_t = G_t * dA_t * h_{t-1}  (gradient w.r.t. the exponent dt_t * A)
        P = torch.empty_like(H)
        P[0].zero_()
        torch.mul(H[:-1], dA[1:], out=P[1:])
        P.mul_(G)
        gdt += (P * A).sum(-1)
        gA = (P * dt.unsqueeze(-1)).sum((0, 1))
        return gx, gdt, gA, gB, gC


def _mixer_forward(mx, hs: torch.Tensor) -> torch.Tensor:
    """Same math as transformers' MambaMixer without cache; hs is time-major (L, B, H)."""
    L = hs.shape[0]
    xz, gate = mx.in_proj(hs).chunk(2, dim=-1)
    xc = xz.permute(1, 2, 0)
    k = mx.conv_kernel_size
    xc = F.conv1d(xc, mx.conv1d.weight, mx.conv1d.bias, padding=k - 1, groups=xc.shape[1])
    xc = F.silu(xc[..., :L]).permute(2, 0, 1)
    ts, Bm, Cm = torch.split(
        mx.x_proj(xc), [mx.time_step_rank, mx.ssm_state_size, mx.ssm_state_size], dim=-1
    )
    dt = F.softplus(F.linear(ts, mx.dt_proj.weight, mx.dt_proj.bias))
    A = -torch.exp(mx.A_log.float())
    y = _SelectiveScan.apply(xc.contiguous(), dt.contiguous(), A, Bm.contiguous(), Cm.contiguous())
    y = (y + xc * mx.D) * F.silu(gate)
    return mx.out_proj(y)


def fast_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """(B, L) token ids -> (B, L, V) logits of a transformers MambaForCausalLM."""
    bb = model.backbone
    h = bb.embeddings(ids).transpose(0, 1)
    for blk in bb.layers:
        h = h + _mixer_forward(blk.mixer, blk.norm(h))
    h = bb.norm_f(h)
    return model.lm_head(h).transpose(0, 1)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


# ----------------------------------------------------------------------------- helpers


def windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping (seq_len + 1)-token windows covering the stream."""
    n = (len(stream) - 1) // seq_len
    idx = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    return stream[idx]


@torch.no_grad()
def eval_loss(model, wins: torch.Tensor, batch: int) -> float:
    total, count = 0.0, 0
    for i in range(0, len(wins), batch):
        w = wins[i : i + batch]
        logits = fast_logits(model, w[:, :-1])
        total += lm_loss(logits, w[:, 1:]).item() * w[:, 1:].numel()
        count += w[:, 1:].numel()
    return total / count


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def unigram_ce(train: torch.Tensor, targets: torch.Tensor, vocab: int) -> float:
    counts = torch.bincount(train, minlength=vocab).double() + 1.0  # add-one smoothing
    logp = torch.log(counts / counts.sum())
    return float(-logp[targets].mean())


def plot_curves(hist: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed; skipping loss_curve.png")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(hist["train_step"], hist["train_loss"], label="train (mean over interval)")
    ax.plot(hist["eval_step"], hist["eval_loss"], "o-", label="held-out")
    ax.axhline(hist["unigram"], color="gray", ls="--", label="unigram baseline (held-out)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("tiny-stdlib Mamba")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- main


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    import transformers
    from transformers import AutoTokenizer, MambaConfig, MambaForCausalLM, PreTrainedTokenizerFast

    # -- data
    root, rels = list_stdlib_files()
    rels, texts, data_files = read_texts(root, rels)
    print(f"skipped {len(data_files)} table-like data files: {', '.join(data_files)}")
    k = args.holdout_every
    train_idx = [i for i in range(len(rels)) if i % k != k - 1]
    held_idx = [i for i in range(len(rels)) if i % k == k - 1]
    train_texts = [texts[i] for i in train_idx]
    held_texts = [texts[i] for i in held_idx]
    print(f"stdlib {root}: {len(rels)} files, {len(train_idx)} train / {len(held_idx)} held-out")

    # -- tokenizer
    tok = train_tokenizer(train_texts, args.vocab_size)
    eot_id = tok.token_to_id(EOT)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=EOT,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    hf_tok.save_pretrained(out)
    # transformers 5 writes "TokenizersBackend"; the classic name loads in 4.x and 5.x alike.
    tcfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tcfg_path.write_text(json.dumps(tcfg, indent=2) + "\n")
    hf_tok = AutoTokenizer.from_pretrained(out)
    probe = held_texts[0]
    assert hf_tok.decode(hf_tok(probe)["input_ids"]) == probe, "tokenizer round trip failed"
    train_stream = encode_stream(tok, train_texts, eot_id)
    held_stream = encode_stream(tok, held_texts, eot_id)
    print(
        f"tokenizer: vocab {tok.get_vocab_size()}, train {len(train_stream)} tokens, "
        f"held-out {len(held_stream)} tokens ({time.time() - t_start:.0f}s)"
    )

    held_wins = windows(held_stream, args.seq_len)
    g = torch.Generator().manual_seed(args.seed + 1)
    eval_wins = held_wins[torch.randperm(len(held_wins), generator=g)[: args.eval_windows]]
    unigram = unigram_ce(train_stream, held_wins[:, 1:].reshape(-1), tok.get_vocab_size())
    print(f"unigram baseline on held-out windows: {unigram:.4f}")

    # -- model
    vocab = int(math.ceil(tok.get_vocab_size() / 16) * 16)
    config = MambaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        state_size=args.state_size,
        conv_kernel=args.conv_kernel,
        expand=args.expand,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        use_cache=True,
    )
    model = MambaForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "A_log" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "A_log" not in n)]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    hist = {"train_step": [], "train_loss": [], "eval_step": [], "eval_loss": []}
    n_windows = len(train_stream) - args.seq_len - 1
    running, running_n = 0.0, 0
    t_train = time.time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(0, n_windows, (args.batch_size,), generator=g)
        batch = train_stream[starts[:, None] + torch.arange(args.seq_len + 1)[None, :]]
        loss = lm_loss(fast_logits(model, batch[:, :-1]), batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        running += loss.item()
        running_n += 1
        last = step == args.steps - 1
        if (step + 1) % args.eval_every == 0 or last:
            model.eval()
            ev = eval_loss(model, eval_wins, 16)
            model.train()
            hist["train_step"].append(step + 1)
            hist["train_loss"].append(running / running_n)
            hist["eval_step"].append(step + 1)
            hist["eval_loss"].append(ev)
            el = time.time() - t_train
            print(
                f"step {step + 1}/{args.steps} train {running / running_n:.4f} held-out {ev:.4f} "
                f"lr {lr_at(step, args):.2e} {el:.0f}s ({el / (step + 1):.2f}s/step)",
                flush=True,
            )
            running, running_n = 0.0, 0
    train_time = time.time() - t_train

    # -- save + verify with the transformers forward
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    held_full = eval_loss(model, held_wins, 16)
    print(f"held-out loss on all {len(held_wins)} windows: {held_full:.4f}")

    hf = MambaForCausalLM.from_pretrained(out)
    hf.eval()
    check = held_wins[:4]
    with torch.no_grad():
        ref = hf(input_ids=check[:, :-1], labels=check[:, :-1]).loss.item()
        ours = lm_loss(fast_logits(hf, check[:, :-1])[:, :-1], check[:, 1:-1]).item()
    print(f"verify: transformers loss {ref:.6f} vs training forward {ours:.6f}")
    assert abs(ref - ours) < 1e-4, (ref, ours)

    tokenizer = AutoTokenizer.from_pretrained(out)
    samples = []
    for prompt in PROMPTS:
        enc = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            gen = hf.generate(
                **enc, max_new_tokens=args.sample_tokens, do_sample=False, pad_token_id=eot_id
            )
        text = tokenizer.decode(gen[0], skip_special_tokens=False)
        samples.append((prompt, text))
        print(f"--- {prompt!r}\n{text}")

    hist["unigram"] = unigram
    plotted = plot_curves(hist, out / "loss_curve.png")
    size = (out / "model.safetensors").stat().st_size
    stats = {
        "files_total": len(rels),
        "files_data_skipped": data_files,
        "files_train": len(train_idx),
        "files_heldout": len(held_idx),
        "train_tokens": len(train_stream),
        "heldout_tokens": len(held_stream),
        "heldout_windows": len(held_wins),
        "params": n_params,
        "safetensors_bytes": size,
        "train_time_s": train_time,
        "total_time_s": time.time() - t_start,
        "final_train_loss": hist["train_loss"][-1],
        "final_heldout_loss": held_full,
        "unigram_ce": unigram,
        "verify_hf_loss": ref,
        "verify_fast_loss": ours,
    }
    write_card(out, args, config, stats, hist, samples, plotted, root, transformers.__version__)
    print(json.dumps(stats, indent=1))


def write_card(out, args, config, s, hist, samples, plotted, root, tf_version):
    py = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    curve = "\n".join(
        f"| {st} | {tr:.3f} | {ev:.3f} |"
        for st, tr, ev in zip(hist["train_step"], hist["train_loss"], hist["eval_loss"])
    )
    sample_md = "\n\n".join(f"Prompt `{p!r}`:\n\n```python\n{t}\n```" for p, t in samples)
    card = f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [mamba, tiny, python-code]
---

# tiny-stdlib: a {s["params"] / 1e6:.2f}M-parameter Mamba trained on the Python standard library

A deliberately tiny `MambaForCausalLM` that ships inside `vllm_mamba` so that the engine can be
tried without a model hub: it really was trained and its greedy output looks like Python.
It is a toy: it knows stdlib-flavoured Python syntax and identifiers, nothing else.

Reproduce with `python scripts/train_tiny_mamba.py` (all settings are its argparse defaults;
{args.threads} CPU thread, seed {args.seed}).

## Data

* Source: every `*.py` file under `sysconfig.get_paths()["stdlib"]` of CPython {py}
  (`{root}`), sorted by relative path; files in directories named
  {", ".join(f"`{d}`" for d in sorted(EXCLUDED_DIRS))} are excluded (this drops `test/`,
  `idlelib/idle_test/`, `lib2to3/tests/`, `unittest/test/`, the codec tables in `encodings/` and
  the one-string module `pydoc_data/topics.py`), as are empty/undecodable files.
* Table-like data files are skipped too: a file of at least {LITERAL_MIN_CHARS} characters in
  which more than {LITERAL_MAX_FRAC:.0%} of the non-blank, non-comment lines start with a string
  or number literal. This rule drops {len(s["files_data_skipped"])} files:
  {", ".join(f"`{f}`" for f in s["files_data_skipped"])}.
* {s["files_total"]} files. Held out **by file**: file index `i` (in the sorted list) with
  `i % {args.holdout_every} == {args.holdout_every - 1}` -> {s["files_heldout"]} held-out files,
  {s["files_train"]} training files.
* Documents are joined with `<|endoftext|>`: {s["train_tokens"]:,} training tokens,
  {s["heldout_tokens"]:,} held-out tokens.

## Tokenizer

Byte-level BPE trained with `tokenizers` on the training files only: vocabulary
{config.vocab_size} (including the single special token `<|endoftext|>`, id 0, used as
bos/eos/pad/unk), `ByteLevel` pre-tokenizer (no prefix space) and `ByteLevel` decoder, so
`decode(encode(text)) == text` for any text, whitespace included. Saved as `tokenizer.json` +
`tokenizer_config.json` (loadable with `transformers.AutoTokenizer`).

## Model

`MambaForCausalLM` (transformers {tf_version}): hidden {config.hidden_size},
{config.num_hidden_layers} layers, d_inner {config.intermediate_size}, state size
{config.state_size}, conv kernel {config.conv_kernel}, dt rank {config.time_step_rank}, tied
input/output embeddings, float32. {s["params"]:,} parameters; `model.safetensors` is
{s["safetensors_bytes"] / 1e6:.2f} MB.

## Training

* {args.steps} steps, batch {args.batch_size} random windows of {args.seq_len} tokens
  ({args.steps * args.batch_size * args.seq_len:,} tokens seen).
* AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices except `A_log`), peak LR
  {args.lr}, {args.warmup} linear warm-up steps then cosine decay to {args.min_lr_ratio}x, grad
  clip {args.grad_clip}.
* Wall time: {s["train_time_s"] / 60:.1f} min of training ({s["total_time_s"] / 60:.1f} min
  total) on 1 CPU thread. The training forward is a PyTorch re-implementation of the
  transformers Mamba forward with a custom-autograd selective scan; after saving, the checkpoint
  was reloaded with `transformers.MambaForCausalLM` and its loss on 4 held-out windows matched
  ({s["verify_hf_loss"]:.6f} vs {s["verify_fast_loss"]:.6f}).

## Results (cross-entropy, nats per token)

| | loss |
|---|---|
| final train loss (mean over the last evaluation interval) | {s["final_train_loss"]:.4f} |
| held-out loss (all {s["heldout_windows"]} non-overlapping {args.seq_len}-token windows) \
| {s["final_heldout_loss"]:.4f} |
| unigram baseline on the same held-out tokens (train counts, add-one) | {s["unigram_ce"]:.4f} |

{"![loss curve](loss_curve.png)" if plotted else ""}

| step | train | held-out ({args.eval_windows} windows) |
|---|---|---|
{curve}

## Greedy samples

Produced with `transformers` `generate(do_sample=False, max_new_tokens={args.sample_tokens})`
from the saved files:

{sample_md}
"""
    (out / "README.md").write_text(card)


if __name__ == "__main__":
    main()
