#!/usr/bin/env python3
"""Train mempath's default model (mempath-tiny) and its speculative-decoding draft.

No model hub is reachable from our machines, so the model that ships with
mempath is trained here from text that every machine with Python has: the
standard library's own source and the documentation text shipped with CPython
(``pydoc_data/topics.py``).

Steps (each a subcommand; ``all`` runs them in order):

  prepare  build the corpus (sorted stdlib paths, held-out split by document),
           train a byte-level BPE tokenizer on the training documents only and
           write the tokenized streams as uint16 arrays.
  train    train a Llama model with grouped-query attention and a 2-layer draft
           on the tokenized streams (a CUDA GPU is expected; CPU works for a
           smoke test with --steps), evaluate held-out perplexity of both and of
           an add-one unigram baseline, and save both in Hugging Face format.
  package  assemble the shipped asset folders: weights + tokenizer files +
           chat template + training.json, a held-out text sample and the
           unigram counts a test needs to compute the baseline on it.
  verify   load both folders with transformers on the CPU, greedy-generate from
           a prompt, and score the held-out sample against the unigram baseline.

Typical use (the corpus differs between Python versions, so ``prepare`` runs
once on one machine and the token arrays travel to the GPU):

  python3 scripts/train_default_model.py prepare --work .work/default_model
  python3 scripts/train_default_model.py train --data .work/default_model --out OUT
  python3 scripts/train_default_model.py package --data .work/default_model --trained OUT
  python3 scripts/train_default_model.py verify
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import platform
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_WORK = REPO / ".work" / "default_model"
DEFAULT_ASSETS = REPO / "mempath" / "assets"
MAIN_NAME = "mempath-tiny"
DRAFT_NAME = "mempath-tiny-draft"

SEED = 1234
VOCAB_SIZE = 8192
HELDOUT_EVERY = 20  # document i is held out when i % 20 == 19 (sorted order)
MAX_FILE_BYTES = 400_000  # larger .py files are generated tables or giant tests

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Order fixes the ids: <|pad|>=0, <|bos|>=1, <|eos|>=2, roles 3..6.
SPECIAL_TOKENS = [PAD, BOS, EOS] + ROLE_TOKENS

# A deliberately small template: role marker, content, <|end|>.  The model is
# not chat-trained; the template only has to render and tokenize to single
# special tokens so the serving code can be exercised end to end.
# The tool-call format is Hermes / Qwen's (<tool_call>...</tool_call>): server/tool_parsers.py reads it.
CHAT_TEMPLATE = (
    '{{ bos_token }}\n'
    '{%- if tools %}<|system|>\n'
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n"
    '\n'
    '{% endif %}You can call functions. Their signatures, in <tools></tools>:\n'
    '<tools>\n'
    '{% for tool in tools %}{{ tool | tojson }}\n'
    '{% endfor %}</tools>\n'
    'To call one, answer with its name and arguments as JSON inside <tool_call></tool_call>:\n'
    '<tool_call>\n'
    '{"name": <function-name>, "arguments": <arguments-object>}\n'
    '</tool_call><|end|>\n'
    '{% endif %}\n'
    '{%- for message in messages %}\n'
    "{%- if tools and loop.first and message['role'] == 'system' %}\n"
    "{%- elif message['role'] == 'tool' %}<|user|>\n"
    '<tool_response>\n'
    "{{ message['content'] }}\n"
    '</tool_response><|end|>\n'
    "{% elif message['role'] in ['system', 'user', 'assistant'] %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}\n"
    "{%- if message['tool_calls'] %}{% for call in message['tool_calls'] %}<tool_call>\n"
    '{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": {% if call[\'function\'][\'arguments\'] is string %}{{ call[\'function\'][\'arguments\'] }}{% else %}{{ call[\'function\'][\'arguments\'] | tojson }}{% endif %}}\n'
    '</tool_call>{% endfor %}{% endif %}<|end|>\n'
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}\n"
    '{%- endif %}\n'
    '{%- endfor %}\n'
    '{%- if add_generation_prompt %}<|assistant|>\n'
    '{% endif %}'
)

# Sizes chosen so both checkpoints plus tokenizer files stay under 30 MB in
# bfloat16 with tied embeddings: main ~10.8M parameters (21.6 MB), draft
# ~2.4M (4.7 MB), tokenizer.json ~0.5 MB per folder.
MODEL_SHAPES = {
    "main": dict(hidden_size=384, intermediate_size=768, num_hidden_layers=6,
                 num_attention_heads=6, num_key_value_heads=2),
    "draft": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=3, num_key_value_heads=1),
}
# Optimisation recipe per model.  Step counts are fixed (not time-based) so a
# rerun with the same seed and corpus reproduces the result.
TRAIN_RECIPE = {
    "main": dict(steps=1600, lr=2e-3, warmup=100),
    "draft": dict(steps=1600, lr=3e-3, warmup=100),
}
SEQ_LEN = 512
BATCH_SIZE = 64
MAX_POSITIONS = 1024


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------

def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def iter_stdlib_sources(root: Path):
    """Yield (relative path, text) of stdlib .py files in sorted path order.

    Skipped: third-party packages, machine-specific build data (the
    _sysconfigdata module and the config-* folder differ between builds of the
    same version), files that are not UTF-8 (some tests carry deliberately
    broken encodings), oversized files, and pydoc_data which is added as text.
    """
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if parts[0] in ("site-packages", "dist-packages", "pydoc_data"):
            continue
        if parts[0].startswith("config-") or parts[-1].startswith("_sysconfigdata"):
            continue
        if "__pycache__" in parts:
            continue
        paths.append(rel)
    for rel in sorted(paths):
        data = (root / rel).read_bytes()
        if len(data) > MAX_FILE_BYTES or not data.strip():
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        yield rel, text


def iter_pydoc_topics(root: Path):
    """Yield (name, text) for each help topic in pydoc_data/topics.py.

    The module is one dict literal of documentation strings; it is read with
    ast rather than imported so the text comes from `root`, not sys.path.
    """
    path = root / "pydoc_data" / "topics.py"
    if not path.exists():
        return
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
            for key in sorted(topics):
                yield f"pydoc_data/topics/{key}", topics[key].strip() + "\n"


def build_corpus(root: Path):
    """Return (train_docs, heldout_docs, manifest); docs are (name, text)."""
    docs = list(iter_stdlib_sources(root)) + list(iter_pydoc_topics(root))
    train, heldout = [], []
    digest = hashlib.sha256()
    for i, (name, text) in enumerate(docs):
        split = heldout if i % HELDOUT_EVERY == HELDOUT_EVERY - 1 else train
        split.append((name, text))
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    manifest = {
        "python": platform.python_version(),
        "stdlib": str(root),
        "documents": len(docs),
        "train_documents": len(train),
        "heldout_documents": len(heldout),
        "heldout_rule": f"document index % {HELDOUT_EVERY} == {HELDOUT_EVERY - 1} "
                        "in sorted path order (stdlib .py files, then pydoc topics)",
        "train_chars": sum(len(t) for _, t in train),
        "heldout_chars": sum(len(t) for _, t in heldout),
        "corpus_sha256": digest.hexdigest(),
        "heldout_names": [n for n, _ in heldout],
    }
    return train, heldout, manifest


# --------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------

def train_tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # Byte-level: every byte string is representable, so no <unk> is needed.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        max_token_length=24,  # keeps long comment rulers from eating vocab
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    # Training documents start with <|bos|>, so plain encoding adds it too:
    # a prompt then looks like the start of a training document.
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1",
        special_tokens=[(BOS, bos_id)])
    return tok


def encode_docs(tok, docs) -> np.ndarray:
    """Concatenate <|bos|> doc <|eos|> for every document, as uint16."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    encodings = tok.encode_batch([t for _, t in docs], add_special_tokens=False)
    out = []
    for enc in encodings:
        out.append(bos)
        out.extend(enc.ids)
        out.append(eos)
    assert tok.get_vocab_size() <= 65536
    return np.asarray(out, dtype=np.uint16)


def cmd_prepare(args) -> None:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    root = Path(args.stdlib) if args.stdlib else stdlib_dir()
    t0 = time.time()
    train, heldout, manifest = build_corpus(root)
    log(f"corpus from {root}: {manifest['train_documents']} train / "
        f"{manifest['heldout_documents']} held-out documents, "
        f"{manifest['train_chars'] / 1e6:.1f}M + {manifest['heldout_chars'] / 1e6:.1f}M chars, "
        f"sha256 {manifest['corpus_sha256'][:16]}")

    tok = train_tokenizer([t for _, t in train])
    tok.save(str(work / "tokenizer.json"))
    train_ids = encode_docs(tok, train)
    heldout_ids = encode_docs(tok, heldout)
    train_ids.tofile(work / "train.u16")
    heldout_ids.tofile(work / "heldout.u16")

    manifest["vocab_size"] = tok.get_vocab_size()
    manifest["tokenizer_sha256"] = hashlib.sha256(
        (work / "tokenizer.json").read_bytes()).hexdigest()
    manifest["train_tokens"] = int(train_ids.size)
    manifest["heldout_tokens"] = int(heldout_ids.size)
    manifest["chars_per_token"] = round(manifest["train_chars"] / train_ids.size, 3)
    (work / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    write_heldout_sample(heldout, work / "heldout.txt")
    log(f"tokenizer vocab {manifest['vocab_size']}, {train_ids.size / 1e6:.2f}M train / "
        f"{heldout_ids.size / 1e6:.2f}M held-out tokens "
        f"({manifest['chars_per_token']} chars/token), {time.time() - t0:.0f}s -> {work}")


def write_heldout_sample(heldout, path: Path, max_bytes: int = 64_000) -> None:
    """A small slice of held-out text for tests: the first lines of held-out
    documents, taken evenly across the held-out list, never training text."""
    step = max(1, len(heldout) // 40)
    chunks, size = [], 0
    for name, text in heldout[::step]:
        chunk = "\n".join(text.splitlines()[:40]).strip("\n") + "\n"
        if size + len(chunk.encode()) > max_bytes:
            break
        chunks.append(chunk)
        size += len(chunk.encode())
    path.write_text("\n".join(chunks), encoding="utf-8")


# --------------------------------------------------------------------------
# model training
# --------------------------------------------------------------------------

def llama_config(kind: str, vocab_size: int):
    from transformers import LlamaConfig

    shape = MODEL_SHAPES[kind]
    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        hidden_act="silu",
        initializer_range=0.02,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        **shape,
    )


def unigram_nll(counts: np.ndarray, targets: np.ndarray) -> float:
    """Mean NLL (nats) of targets under an add-one smoothed unigram model."""
    logp = np.log((counts + 1.0) / (counts.sum() + counts.size))
    return float(-logp[targets].mean())


def eval_windows(stream, seq_len: int):
    """Split a token stream into windows of seq_len+1 tokens that overlap by
    one, so every token after the first is a target exactly once; the short
    tail is dropped.  Returns a [n, seq_len+1] view."""
    n = (stream.numel() - 1) // seq_len
    return stream[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)


def evaluate(model, windows, batch: int, autocast: bool) -> float:
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast(windows.device.type, dtype=torch.bfloat16,
                                         enabled=autocast):
        for i in range(0, windows.size(0), batch):
            w = windows[i: i + batch]
            logits = model(input_ids=w[:, :-1]).logits.float()
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                   w[:, 1:].reshape(-1), reduction="sum")
            total += loss.item()
            count += w[:, 1:].numel()
    model.train()
    return total / count


def train_one(kind: str, train_ids, heldout_windows, vocab_size: int, args, device):
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    recipe = dict(TRAIN_RECIPE[kind])
    if args.steps:
        recipe["steps"] = args.steps
        recipe["warmup"] = min(recipe["warmup"], max(1, args.steps // 10))
    steps, warmup, peak_lr = recipe["steps"], recipe["warmup"], recipe["lr"]
    seq, batch = args.seq_len, args.batch_size

    # Same seed for both models: identical initial draws and data order.
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    config = llama_config(kind, vocab_size)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa",
                                          dtype=torch.float32).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{kind}: {n_params / 1e6:.2f}M parameters, {steps} steps x {batch} x {seq} tokens")

    # Decay matrices only; norms (1-D) are left alone as usual.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")

    def lr_at(step):  # linear warm-up, cosine decay to 10% of peak
        if step < warmup:
            return peak_lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    offsets_arange = torch.arange(seq + 1, device=device)
    autocast = device.type == "cuda"
    probe = heldout_windows[: min(64, heldout_windows.size(0))]
    curve = []
    t0 = time.time()
    step = 0
    for step in range(steps):
        # Random windows anywhere in the training stream; the offsets come from
        # a seeded numpy Generator so the data order is reproducible.
        starts = torch.from_numpy(rng.integers(0, train_ids.numel() - seq - 1, size=batch))
        w = train_ids[starts.to(device)[:, None] + offsets_arange]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=w[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, vocab_size), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        last = step == steps - 1
        if step % args.log_every == 0 or last:
            train_loss = loss.item()
            probe_loss = evaluate(model, probe, args.eval_batch, autocast)
            elapsed = time.time() - t0
            curve.append({"step": step, "train_loss": round(train_loss, 4),
                          "heldout_probe_loss": round(probe_loss, 4),
                          "seconds": round(elapsed, 1)})
            log(f"{kind} step {step:5d} loss {train_loss:.3f} held-out probe "
                f"{probe_loss:.3f} lr {lr_at(step):.2e} {elapsed:.0f}s")
        # A safety net against losing the whole device run: it should never
        # fire with the shipped step counts; when it does it is recorded.
        if time.time() > args.deadline[kind]:
            log(f"{kind}: deadline reached after {step + 1} steps, stopping early")
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.time() - t0
    steps_done = step + 1

    log(f"{kind}: trained {steps_done} steps in {train_seconds:.0f}s "
        f"({steps_done * batch * seq / train_seconds / 1e3:.0f}k tok/s incl. probes)")
    result = {
        "parameters": n_params,
        "steps": steps,
        "steps_done": steps_done,
        "stopped_early": steps_done < steps,
        "peak_lr": peak_lr,
        "warmup_steps": warmup,
        "train_seconds": round(train_seconds, 1),
        "tokens_seen": steps_done * batch * seq,
        "curve": curve,
    }
    return model, result


def save_and_evaluate(model, path: Path, windows, eval_batch: int, device) -> float:
    """Save in bfloat16 HF format, then score what was saved: reloading (rather
    than casting in place) also keeps the rotary frequencies in float32, as a
    user's from_pretrained does."""
    import torch
    from transformers import LlamaForCausalLM

    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    gen = model.generation_config
    gen.bos_token_id = model.config.bos_token_id
    gen.pad_token_id = model.config.pad_token_id
    # Stop at <|eos|> and at the chat template's <|end|>.
    gen.eos_token_id = [model.config.eos_token_id, SPECIAL_TOKENS.index("<|end|>")]
    model.save_pretrained(path, safe_serialization=True)
    shipped = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                               attn_implementation="sdpa").to(device)
    return evaluate(shipped, windows, eval_batch, autocast=False)


def cmd_train(args) -> None:
    import torch

    t_start = time.time()
    data = Path(args.data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((data / "manifest.json").read_text())
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"cpu ({platform.processor() or platform.machine()})"
    log(f"device {device_name}, torch {torch.__version__}, corpus "
        f"{manifest['corpus_sha256'][:16]} (python {manifest['python']})")

    train_np = np.fromfile(data / "train.u16", dtype=np.uint16)
    heldout_np = np.fromfile(data / "heldout.u16", dtype=np.uint16)
    vocab_size = manifest["vocab_size"]
    train_ids = torch.from_numpy(train_np.astype(np.int64)).to(device)
    heldout_ids = torch.from_numpy(heldout_np.astype(np.int64)).to(device)
    windows = eval_windows(heldout_ids, args.seq_len)
    if args.max_eval_windows:
        windows = windows[: args.max_eval_windows]

    # The unigram baseline is scored on exactly the targets the models see.
    counts = np.bincount(train_np, minlength=vocab_size).astype(np.float64)
    targets = windows[:, 1:].reshape(-1).cpu().numpy()
    uni_nll = unigram_nll(counts, targets)
    log(f"unigram baseline: held-out loss {uni_nll:.4f} ppl {math.exp(uni_nll):.2f} "
        f"on {targets.size} target tokens")

    # Deadlines (safety net only): the main model may use ~60% of the budget.
    args.deadline = {"main": t_start + 0.6 * args.time_budget,
                     "draft": t_start + 0.92 * args.time_budget}
    results = {}
    for kind in ("main", "draft"):
        name = MAIN_NAME if kind == "main" else DRAFT_NAME
        model, res = train_one(kind, train_ids, windows, vocab_size, args, device)
        nll = save_and_evaluate(model, out / name, windows, args.eval_batch, device)
        res["heldout_loss"] = round(nll, 5)
        res["heldout_ppl"] = round(math.exp(nll), 3)
        results[kind] = res
        log(f"{kind}: held-out loss {nll:.4f} ppl {math.exp(nll):.2f} (saved bfloat16 weights)")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    record = {
        "seed": args.seed,
        "device": device_name,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
        "corpus_python": manifest["python"],
        "corpus_sha256": manifest["corpus_sha256"],
        "tokenizer_sha256": manifest["tokenizer_sha256"],
        "vocab_size": vocab_size,
        "train_tokens": manifest["train_tokens"],
        "heldout_tokens_scored": int(targets.size),
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "shapes": MODEL_SHAPES,
        "heldout_ppl": {
            "main": results["main"]["heldout_ppl"],
            "draft": results["draft"]["heldout_ppl"],
            "unigram": round(math.exp(uni_nll), 3),
        },
        "unigram_heldout_loss": round(uni_nll, 5),
        "models": results,
        "wall_seconds": round(time.time() - t_start, 1),
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    log("held-out perplexity: main {main} draft {draft} unigram {unigram}".format(
        **record["heldout_ppl"]))
    log(f"done in {record['wall_seconds']}s -> {out}")


# --------------------------------------------------------------------------
# packaging and verification
# --------------------------------------------------------------------------

def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": ROLE_TOKENS,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def cmd_package(args) -> None:
    data, trained, assets = Path(args.data), Path(args.trained), Path(args.assets)
    manifest = json.loads((data / "manifest.json").read_text())
    record = json.loads((trained / "training.json").read_text())
    if record["corpus_sha256"] != manifest["corpus_sha256"]:
        sys.exit("trained weights come from a different corpus than --data")
    record["command"] = args.command_line or " ".join(sys.argv)
    record["corpus"] = {k: manifest[k] for k in (
        "python", "documents", "train_documents", "heldout_documents", "heldout_rule",
        "train_chars", "heldout_chars", "chars_per_token")}
    # Other runs of the same command, recorded as evidence of reproducibility.
    record["repeat_runs"] = []
    for other in args.repeat_run or []:
        rec = json.loads(Path(other).read_text())
        record["repeat_runs"].append({k: rec[k] for k in (
            "seed", "device", "corpus_sha256", "heldout_ppl", "wall_seconds")})
    for name in (MAIN_NAME, DRAFT_NAME):
        dst = assets / name
        dst.mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "generation_config.json", "model.safetensors"):
            shutil.copyfile(trained / name / f, dst / f)
        shutil.copyfile(data / "tokenizer.json", dst / "tokenizer.json")
        (dst / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1) + "\n")
        (dst / "special_tokens_map.json").write_text(json.dumps({
            "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
            "additional_special_tokens": ROLE_TOKENS}, indent=1) + "\n")
        (dst / "training.json").write_text(
            json.dumps(dict(record, this_model=name), indent=1) + "\n")
    # Held-out sample plus training unigram counts, so a test can compare a
    # model's log-likelihood with the unigram baseline without the corpus.
    shutil.copyfile(data / "heldout.txt", assets / "heldout.txt")
    counts = np.bincount(np.fromfile(data / "train.u16", dtype=np.uint16),
                         minlength=manifest["vocab_size"])
    (assets / "unigram_counts.json").write_text(json.dumps({
        "tokenizer": MAIN_NAME,
        "smoothing": "add-one: p(t) = (counts[t] + 1) / (total + vocab_size)",
        "vocab_size": manifest["vocab_size"],
        "total": int(counts.sum()),
        "corpus_sha256": manifest["corpus_sha256"],
        "counts": counts.tolist(),
    }, separators=(",", ":")) + "\n")
    total = sum(f.stat().st_size for n in (MAIN_NAME, DRAFT_NAME) for f in (assets / n).iterdir())
    log(f"packaged into {assets}: {total / 1e6:.2f} MB for both model folders")


def cmd_verify(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assets = Path(args.assets)
    uni = json.loads((assets / "unigram_counts.json").read_text())
    counts = np.asarray(uni["counts"], dtype=np.float64)
    sample = (assets / "heldout.txt").read_text(encoding="utf-8")
    report = {}
    for name in (MAIN_NAME, DRAFT_NAME):
        path = assets / name
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        model.eval()
        chat = tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
        chat_ids = tok(chat, add_special_tokens=False)["input_ids"]
        assert all(tok.convert_ids_to_tokens(chat_ids).count(t) == 1
                   for t in (BOS, "<|user|>", "<|end|>", "<|assistant|>")), chat_ids

        ids = tok(args.prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=40, do_sample=False)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)

        # Held-out sample scored in windows, like the training evaluation.
        stream = torch.tensor(tok(sample, verbose=False)["input_ids"])
        windows = eval_windows(stream, SEQ_LEN)
        nll = evaluate(model, windows, 8, autocast=False)
        uni_nll = unigram_nll(counts, windows[:, 1:].reshape(-1).numpy())
        report[name] = {"dtype": str(model.dtype), "heldout_txt_ppl": round(math.exp(nll), 3),
                        "unigram_heldout_txt_ppl": round(math.exp(uni_nll), 3),
                        "sample": args.prompt + text}
        log(f"{name}: {model.num_parameters() / 1e6:.2f}M params ({model.dtype}); heldout.txt "
            f"ppl {math.exp(nll):.2f} vs unigram {math.exp(uni_nll):.2f}\n"
            f"--- greedy 40 tokens ---\n{args.prompt}{text}\n---")
    if args.write:
        for name in (MAIN_NAME, DRAFT_NAME):
            path = assets / name / "training.json"
            rec = json.loads(path.read_text())
            rec["verify_cpu"] = report
            path.write_text(json.dumps(rec, indent=1) + "\n")


# --------------------------------------------------------------------------

def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    def add_train_args(sp):
        sp.add_argument("--seed", type=int, default=SEED)
        sp.add_argument("--steps", type=int, default=0,
                        help="override the step count of both models (smoke tests)")
        sp.add_argument("--batch-size", type=int, default=BATCH_SIZE)
        sp.add_argument("--seq-len", type=int, default=SEQ_LEN)
        sp.add_argument("--eval-batch", type=int, default=64)
        sp.add_argument("--max-eval-windows", type=int, default=0,
                        help="score only this many held-out windows (smoke tests)")
        sp.add_argument("--log-every", type=int, default=100)
        sp.add_argument("--time-budget", type=float, default=540,
                        help="seconds; a safety net that stops training early")
        sp.add_argument("--device", default=None)

    sp = sub.add_parser("prepare", help="corpus, tokenizer and token arrays")
    sp.add_argument("--work", default=str(DEFAULT_WORK))
    sp.add_argument("--stdlib", default=None, help="stdlib folder (default: this Python's)")

    sp = sub.add_parser("train", help="train main and draft models")
    sp.add_argument("--data", default=str(DEFAULT_WORK))
    sp.add_argument("--out", required=True)
    add_train_args(sp)

    sp = sub.add_parser("package", help="assemble the shipped asset folders")
    sp.add_argument("--data", default=str(DEFAULT_WORK))
    sp.add_argument("--trained", required=True)
    sp.add_argument("--assets", default=str(DEFAULT_ASSETS))
    sp.add_argument("--command-line", default=None, help="training command to record")
    sp.add_argument("--repeat-run", action="append",
                    help="training.json of another run of the same command to record")

    sp = sub.add_parser("verify", help="load with transformers, generate, score")
    sp.add_argument("--assets", default=str(DEFAULT_ASSETS))
    sp.add_argument("--prompt", default="def read_config(path):")
    sp.add_argument("--write", action="store_true", help="record results in training.json")

    sp = sub.add_parser("all", help="prepare, train, package, verify")
    sp.add_argument("--work", default=str(DEFAULT_WORK))
    sp.add_argument("--stdlib", default=None)
    sp.add_argument("--assets", default=str(DEFAULT_ASSETS))
    add_train_args(sp)

    args = p.parse_args(argv)
    if args.cmd == "prepare":
        cmd_prepare(args)
    elif args.cmd == "train":
        cmd_train(args)
    elif args.cmd == "package":
        cmd_package(args)
    elif args.cmd == "verify":
        cmd_verify(args)
    elif args.cmd == "all":
        cmd_prepare(args)
        args.data = args.work
        args.out = str(Path(args.work) / "trained")
        cmd_train(args)
        args.trained, args.command_line, args.repeat_run = args.out, None, None
        cmd_package(args)
        args.prompt, args.write = "def read_config(path):", True
        cmd_verify(args)


if __name__ == "__main__":
    main()
