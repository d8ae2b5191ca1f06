"""Tests against independent references: hand-computed math, Hugging Face's own loss, naive float32
code, a 1-rank run. Tiny models, a few minutes on 2 cores: `pytest test_dpo.py`.

The trainer's runs here mean the CPU (--device cpu, gloo), so they compare bit for bit with CPU
references on any machine. Tests that need a GPU say so (needs_cuda) and are skipped without one;
they run the same checks on CUDA with nccl.

The runs that take processes of their own (torchrun's ranks, signals, bench scripts) start in a
thread of their own as the suite begins (Background), while the tests in this process run on one
thread: on 2 cores the two overlap."""

import ast
import concurrent.futures
import contextlib
import copy
import dataclasses
import errno
import functools
import glob
import io
import itertools
import json
import logging
import math
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
import tokenize as pytokenize
import types
import typing
import weakref

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import transformers
import tyro
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import train_dpo
import batches
import checkpoint
import data
import fsdp_setup
import generate
import logps
import loss
import memory
import metrics
import models
import precision
import schedule
from batches import (
    BatchConfig,
    build_batches,
    build_eval_batches,
    collate_rows,
    micro_batch_groups,
    rank_share,
    row_lengths,
    row_pairs,
)
from data import (
    DataConfig,
    DataError,
    RowTokens,
    load_tokenizer,
    load_tokens,
    read_rows,
    tokenize_rows,
    tokenize_to_cache,
    write_jsonl,
)
from demo import demo_files, demo_pairs, demo_unpaired, score_completion
from fsdp_setup import FSDPConfig, find_block_class, full_tensors
from lora import LoraConfig, WithoutAdapters, add_adapters, initial_weights
from logps import _TokenLogps, add_scored_head, response_logps, sequence_logps
from loss import LossConfig, listwise_loss, pair_losses, preference_loss
from metrics import PAIR_METRICS, device_peak_flops
from models import build_model, load_model_config, open_weights
from precision import PrecisionConfig, resolve_precision

HERE = os.path.dirname(os.path.abspath(__file__))
ON_CPU = ("--device", "cpu")
GPUS = torch.cuda.device_count()
needs_cuda = pytest.mark.skipif(not GPUS, reason="needs a CUDA GPU")
needs_cuda_bf16 = pytest.mark.skipif(
    not GPUS or not torch.cuda.is_bf16_supported(including_emulation=False),
    reason="needs a CUDA GPU with native bfloat16",
)
CACHE = tempfile.mkdtemp(prefix="dpo-test-cache-")  # tokenized data, shared by the tests' runs
# The tests in this process take one thread unless OMP_NUM_THREADS says otherwise: on 2 cores the
# other one runs Background's processes meanwhile. Processes started here take as many, so that a
# run there computes what it computes here.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)
SUBPROCESS_ENV = {
    **os.environ,
    "OMP_NUM_THREADS": str(torch.get_num_threads()),
    "PYTHONPATH": HERE,
}  # the repo's files importable from a script in tmp_path
CPU = torch.device("cpu")


@contextlib.contextmanager
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tiny_config():
    """The trainer's default model's config and tokenizer."""
    tokenizer = load_tokenizer("tiny")
    return load_model_config("tiny", tokenizer), tokenizer


def tiny_model(config, seed):
    """The tiny model as the trainer initializes it (models.open_weights), whole, on CPU."""
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def tiny(seed):
    """The trainer's default model, built in full on CPU with its output layer scoring responses,
    and its tokenizer."""
    config, tokenizer = tiny_config()
    return add_scored_head(tiny_model(config, seed)), tokenizer


def as_row(pair):
    """A {"prompt", "chosen", "rejected"} pair as the row of 2 responses scored (1, 0) it is."""
    return {
        "prompt": pair["prompt"],
        "responses": [pair["chosen"], pair["rejected"]],
        "scores": [1.0, 0.0],
    }


def as_pair(row):
    """A pair file's row (read_rows' or a RowTokens'), its responses scored (1, 0), as {"prompt",
    "chosen", "rejected"}."""
    assert row["scores"] == [1.0, 0.0], row["scores"]
    chosen, rejected = row["responses"]
    return {"prompt": row["prompt"], "chosen": chosen, "rejected": rejected}


def collate_pairs(pairs, pad_id, share_prompt=False, **layout):
    """batches.collate_rows of {"prompt", "chosen", "rejected"} id lists: their responses come
    [all chosen; all rejected], pair i's pair (chosen i, rejected i)."""
    return collate_rows([as_row(p) for p in pairs], pad_id, share_prompt, **layout)


def side_logps(policy, reference, batch, objective, ref_logps=None):
    """(policy, reference, WPO log-weights) (2P,) [chosen; rejected] log-probs of a preference
    objective's pairs, as the trainer's step makes them (logps.response_logps, then the pairs'
    sides; LD-DPO's are per pair already); the reference's and the weights None where there are
    none."""
    if reference is not None:
        with torch.no_grad():
            ref_logps = response_logps(reference, batch, objective.ld_alpha)
    values = response_logps(policy, batch, objective.ld_alpha, objective.use_weighting)
    weights = None
    if objective.use_weighting:
        values, weights = values
        weights = batch.pair_sides(weights)
    if objective.ld_alpha is None:
        values = batch.pair_sides(values)
        ref_logps = None if ref_logps is None else batch.pair_sides(ref_logps)
    return values, ref_logps, weights


def forward_pairs(policy, reference, batch, objective, ref_logps=None, tokens_per_pair=None):
    """The trainer's forward and loss of a micro-batch (train_dpo.micro_batch_loss): loss.Losses;
    `ref_logps` (R,) stands for --ref precompute's rows."""
    return train_dpo.micro_batch_loss(
        objective, policy, reference, batch, ref_logps, tokens_per_pair
    )


def tokenize(pairs, tok, max_length=128, max_prompt_length=64, truncation="keep_end"):
    """data.tokenize_rows on in-memory {"prompt", "chosen", "rejected"} dicts, as a list of token
    dicts {"prompt", "chosen", "rejected"}."""
    rows = [
        {
            **as_row({"prompt": None, **p}),
            "cut": [False, False],
            "fields": ["chosen", "rejected"],
            "where": f"test:{i + 1}",
        }
        for i, p in enumerate(pairs)
    ]
    config = DataConfig(
        max_length=max_length, max_prompt_length=max_prompt_length, truncation=truncation
    )
    tokens, _ = tokenize_rows(rows, tok, config)
    return [as_pair(tokens[i]) for i in range(len(tokens))]


def as_tokens(pairs):
    """RowTokens from a list of {"prompt", "chosen", "rejected"} id lists."""
    flat = [i for p in pairs for k in ("prompt", "chosen", "rejected") for i in p[k]]
    lengths = [[len(p[k]) for k in ("prompt", "chosen", "rejected")] for p in pairs]
    scores = [[1.0, 0.0]] * len(pairs)
    return RowTokens(
        torch.tensor(flat, dtype=torch.int32), torch.tensor(lengths), torch.tensor(scores)
    )


def prepare_data(config, tokenizer, cache_dir):
    """(train, eval, summary) of a DataConfig on one process, cached in cache_dir."""
    return load_tokens(
        tokenize_to_cache(dataclasses.replace(config, cache_dir=cache_dir), tokenizer)
    )


def _write_jsonl(path, rows):
    return write_jsonl(str(path), rows)


def hf_labels(batch, pairs):
    """Hugging Face's labels of `pairs` in separate rows (batch: their collate_pairs): each row's
    response ids, -100 on its prompt and padding."""
    labels = torch.full_like(batch.input_ids, -100)
    rows = [(p["prompt"], p[key]) for key in ("chosen", "rejected") for p in pairs]
    for i, (prompt, response) in enumerate(rows):
        labels[i, len(prompt) : len(prompt) + len(response)] = torch.tensor(response)
    return labels


def read_metrics(out_dir, split="train"):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["split"] == split]


PLOT_METRICS = metrics.plot_metrics


@pytest.fixture(scope="session", autouse=True)
def _no_plots():
    """The tests' runs draw no metrics.png (matplotlib takes longer than a tiny run's step); the
    plot has its own test, which puts metrics.plot_metrics back."""

    def skip_plot(jsonl_path, png_path):
        return True

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(metrics, "plot_metrics", skip_plot)
        yield


# The held-out set of the tests' demo runs: the first 16 of the demo's 256, so that an evaluation is
# cheap.
HELD_OUT_PAIRS = demo_pairs("eval")[:16]
HELD_OUT = write_jsonl(os.path.join(CACHE, "held-out.jsonl"), HELD_OUT_PAIRS)


def trainer_args(out, *args, device="cpu"):
    """The tests' train_dpo.py flags: the demo data with HELD_OUT (unless args name data), batches
    of 16, no samples or step-0 evaluation unless asked."""
    held_out = []
    if not {"--data", "--eval-data", "--eval-fraction"} & set(args):
        held_out = ["--eval-data", HELD_OUT]
    return [
        "--out-dir",
        str(out),
        "--cache-dir",
        CACHE,
        "--batch-size",
        "16",
        "--warmup-steps",
        "2",
        "--num-samples",
        "0",
        "--no-eval-before",
        "--no-warm-start",
        "--device",
        device,
        *held_out,
        *args,
    ]


def run(tmp_path, name, *args, device="cpu"):
    """train_dpo.main in this process (trainer_args); returns the out_dir."""
    out = str(tmp_path / name)
    train_dpo.main(trainer_args(out, *args, device=device))
    return out


def torchrun(nproc, out, *args, script=None, device="cpu", env=None):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script or os.path.join(HERE, "train_dpo.py")),
        *trainer_args(out, *args, device=device),
    ]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**SUBPROCESS_ENV, "OMP_NUM_THREADS": "1", **(env or {})},
    )  # a core per rank


RUNS = """
import json, os, runpy, sys
import checkpoint, data, fsdp_setup, train_dpo
real, calls = data.tokenize_rows, []
real_find, finds = checkpoint.find_checkpoint, []

def tokenize_rows(*args, **kwargs):  # counted: which ranks tokenize
    calls.append(1)
    return real(*args, **kwargs)

def find_checkpoint(*args):  # counted: which ranks resolve --resume
    finds.append(1)
    return real_find(*args)

data.tokenize_rows = tokenize_rows
checkpoint.find_checkpoint = find_checkpoint
for run in json.loads(sys.argv[1]):  # runs in turn, each with a process group of its own
    # A script's main(argv) instead of the trainer's: its patches last as long as the call.
    argv, main = run, train_dpo.main
    if isinstance(run, dict):
        argv, main = run["argv"], runpy.run_path(run["script"])["main"]
    if "--out-dir" in argv:
        out_dir = argv[argv.index("--out-dir") + 1]
    else:  # generate.py's: where --out's file goes
        out_dir = os.path.dirname(argv[argv.index("--out") + 1])
    if os.environ["RANK"] == "0":
        print("--- run " + out_dir, file=sys.stderr, flush=True)  # run_lines's mark
    calls.clear()
    finds.clear()
    error = code = None
    try:
        main(argv)
    except RuntimeError as e:  # recorded for the test to read: the next run goes on
        error = str(e)
    except SystemExit as e:
        code = e.code
    os.makedirs(out_dir, exist_ok=True)  # a run that failed early made none
    with open(os.path.join(out_dir, f"run-{os.environ['RANK']}.json"), "w") as f:
        record = {"tokenize_calls": len(calls), "resolves": len(finds), "error": error}
        json.dump({**record, "exit": code}, f)
fsdp_setup.exit_without_shutdown(0)
"""
# How the line starts that torchrun_runs's rank 0 writes to stderr as a run starts, with its
# out_dir.
RUN_START = "--- run "


def torchrun_runs(nproc, runs, pythonpath=()):
    """Several runs in turn in one start of nproc ranks: fewer process starts. A run is a list of
    trainer_args, or {"argv": trainer_args, "script": a file whose main(argv) runs instead of
    train_dpo.main, patching only while it runs}. Each run's out_dir gets run-{rank}.json: its
    data.tokenize_rows calls there, its checkpoint.find_checkpoint calls ("resolves"), the
    RuntimeError that ended it and its sys.exit code ("exit"); run_lines finds its lines."""
    script = os.path.join(CACHE, "runs.py")
    with open(script, "w") as f:
        f.write(RUNS)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        script,
        json.dumps(runs),
    ]
    env = {
        **SUBPROCESS_ENV,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([HERE, *pythonpath]),
    }
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def run_ranks(nproc, outs, runs, pythonpath=()):
    """torchrun_runs(nproc, runs, pythonpath), for Background: ({name: out_dir}, its
    CompletedProcess)."""
    return outs, torchrun_runs(nproc, runs, pythonpath)


def run_lines(stderr, out):
    """What rank 0 wrote to stderr in torchrun_runs's run `out` (lines of rank 1 may mix in)."""
    return stderr.split(f"{RUN_START}{out}\n")[1].split(RUN_START)[0]


def run_records(out, ranks):
    """torchrun_runs's run-{rank}.json of a run, rank by rank."""
    return [json.load(open(os.path.join(out, f"run-{r}.json"))) for r in range(ranks)]


def assert_runs_ended(proc, outs, ranks):
    """A torchrun_runs start exited 0 and each of its runs in `outs` ended on every rank with
    neither an error nor an exit code."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    for out in outs:
        records = [(r["error"], r["exit"]) for r in run_records(out, ranks)]
        assert records == [(None, None)] * ranks, proc.stderr[-3000:]


class Background:
    """The suite's runs in processes of their own, one after another in a thread of their own while
    the tests go on in this one: on 2 cores their processes take the core this one leaves. A run's
    start function, given the fixture request and a fresh folder, writes the run's inputs (in this
    thread) and returns what the background thread calls: (function, *args). result(name) waits for
    that call's value, starting the run first if nothing has."""

    def __init__(self, request, tmp_path_factory, starts):
        self.request = request
        self.tmp_path_factory = tmp_path_factory
        self.starts = starts
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.futures = {}

    def start(self, name):
        if name not in self.futures:
            folder = self.tmp_path_factory.mktemp(name)
            function, *args = self.starts[name](self.request, folder)
            self.futures[name] = self.executor.submit(function, *args)

    def result(self, name):
        self.start(name)
        return self.futures[name].result()

    def close(self):
        # What has not started never will; a run under way ends within its timeout.
        self.executor.shutdown(cancel_futures=True)


def load_safetensors(folder):
    return load_safetensors_file(os.path.join(folder, "model.safetensors"))


def _adapters(out):
    """A LoRA run's exported adapters."""
    return load_safetensors_file(os.path.join(out, "final", "adapter_model.safetensors"))


def load_safetensors_file(path):
    from safetensors.torch import load_file

    return load_file(path)


def _bos_tokenizer():
    """A character-level fast tokenizer that, like Llama's, puts BOS before text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {
        "<pad>": 0,
        "<s>": 1,
        "</s>": 2,
        **{c: i + 3 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")},
    }
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def sharded_tiny(seed, precision="fp32", frozen=False, **fsdp):
    """The trainer's own path: parameters on the meta device, sharded, each rank's rows read from
    the weights."""
    config, tok = tiny_config()
    cfg = train_dpo.Config(fsdp=FSDPConfig(**fsdp))

    def make():
        return train_dpo.prepare_model(cfg, build_model(config))

    mp_policy = resolve_precision(PrecisionConfig(precision), CPU).mp_policy
    model = fsdp_setup.build_sharded(
        make, open_weights("tiny", config, seed), mp_policy, CPU, cfg.fsdp, frozen
    )
    return model, tiny_model(config, seed), tok


def full_state(model):
    """The full weights on CPU by name, a tied weight once: what the export writes."""
    return {name: fetch().cpu() for name, _, fetch in full_tensors(model, CPU)}


def converted_model(kind):
    """A tiny random model of `kind` (CONVERTED) by transformers, with a tokenizer, in CACHE."""
    folder = os.path.join(CACHE, f"model-{kind}")
    if os.path.isdir(folder):
        return folder
    # transformers loads Mixtral folders with a fast tokenizer only.
    tok = _bos_tokenizer() if kind == "mixtral" else load_tokenizer("tiny")
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    moe = dict(num_experts_per_tok=2, num_key_value_heads=2, intermediate_size=64)
    config = {
        "gpt_neox": transformers.GPTNeoXConfig(
            intermediate_size=128, tie_word_embeddings=False, **common
        ),
        "qwen3_moe": transformers.Qwen3MoeConfig(
            moe_intermediate_size=64, num_experts=4, head_dim=16, **moe, **common
        ),
        "mixtral": transformers.MixtralConfig(num_local_experts=4, **moe, **common),
    }[kind]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# Weights of two runs that differ only in float rounding (another split of the batch, other ranks),
# after a few Adam steps at the tiny model's lr of 1e-3: Adam divides each gradient by its own
# running scale, so a weight whose gradient is near 0 moves by a share of lr that the rounding
# decides (seen: 4e-5 on an AMX CPU). A tenth of one step's lr still catches any real difference in
# the math.
ADAM_ATOL = 1e-4

# The other quantities two such runs log, each bounded at its own scale (_rounding_bound): one
# relative bound for all is either loose for the large ones or below rounding for the small ones.
# A summed log-prob adds up hundreds of per-token log-probs, each from float32 matmuls (2^-24
# relative per operation) summed in another order; after a few steps the weights differ too, most
# where the gradient is near 0, which is where the log-probs depend on them least. LOGP_REL of the
# log-prob is about 100 times float32's unit roundoff.
LOGP_REL = 1e-5
# A reward is beta x (policy - reference) and a margin beta x (chosen - rejected): differences of
# log-probs far smaller than either, so their error is beta x the log-probs' (LOGP_REL of each), not
# a share of the reward itself. The loss is of order 1 and smooth in the rewards: RUN_REL of itself
# (or within its rewards' bound). A reward accuracy is a share of pairs, alike unless a margin lies
# within rounding of 0.
RUN_REL = 1e-4
# The gradient norm adds up the squares of every weight's gradient, each a sum over the batch (in
# another order on other ranks) taken at weights that Adam has already moved apart where gradients
# are near 0 (ADAM_ATOL); the most rounding-sensitive figure a run logs, still far below what any
# change to the math moves it by (percents).
GRAD_NORM_REL = 1e-3

# Float32 math against a reference of the same formula on the same inputs (float64, or float32 in
# another order): each float32 operation rounds its result by up to half of F32_EPS, and a loss of a
# few log-probs, or a log-softmax over a small vocabulary summed over a few tokens, takes at most
# ~20 such roundings: F32_REL of its scale (of itself, or of its order-1 terms where it nears 0). A
# log-prob summed over up to ~100 tokens, or from a model's forward, takes LOGP_REL instead, of
# itself and (a logit minus a log-sum-exp, of order 1 to 10) as an absolute bound near 0.
F32_EPS = torch.finfo(torch.float32).eps
F32_REL = 10 * F32_EPS
# bf16 keeps 8 significant bits: each bf16 operation rounds by up to half of BF16_EPS (2^-7).
BF16_EPS = torch.finfo(torch.bfloat16).eps


def _assert_close_at_scale(actual, expected, rel):
    """Tensors (gradients, matched in order; skipped where `expected` has None) elementwise within
    `rel` of each expected tensor's largest magnitude: an element adds up terms from many tokens
    that cancel, so its rounding is a share of the terms' size, not of its own. Plus F32_REL of
    the largest of all: a bias that a softmax ignores gets terms of the model's size that cancel to
    0."""
    pairs = [(a, e) for a, e in zip(actual, expected, strict=True) if e is not None]
    floor = F32_REL * max(e.abs().max().item() for _, e in pairs)
    for a, e in pairs:
        torch.testing.assert_close(a, e, rtol=0, atol=rel * e.abs().max().item() + floor)


def _shared_config(kind):
    """A tiny random config of `kind`, one of SHARED_KINDS (OPT's learned positions come from
    position_ids when given, in transformers 5.23, so it shares too). Gemma 2's and Mistral's
    sliding windows (8) are shorter than the rows."""
    common = dict(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=256,
    )
    moe = dict(common, num_experts_per_tok=2, intermediate_size=48)
    opt = dict(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        ffn_dim=96,
        num_attention_heads=4,
        max_position_embeddings=256,
    )
    gpt = dict(vocab_size=300, n_positions=256, n_embd=64, n_layer=2, n_head=4)
    no_kv = {k: v for k, v in common.items() if k != "num_key_value_heads"}
    made = {
        "llama": (transformers.LlamaConfig, common),
        "mistral": (transformers.MistralConfig, dict(common, sliding_window=8)),
        "mixtral": (transformers.MixtralConfig, dict(moe, sliding_window=8, num_local_experts=4)),
        "qwen2": (transformers.Qwen2Config, common),
        "qwen3": (transformers.Qwen3Config, dict(common, head_dim=16)),
        "qwen3_moe": (
            transformers.Qwen3MoeConfig,
            dict(moe, head_dim=16, num_experts=4, moe_intermediate_size=48),
        ),
        "gemma": (transformers.GemmaConfig, dict(common, head_dim=16)),
        "gemma2": (transformers.Gemma2Config, dict(common, head_dim=16, sliding_window=8)),
        "gpt2": (transformers.GPT2Config, gpt),
        "gpt_neox": (transformers.GPTNeoXConfig, no_kv),
        "phi3": (transformers.Phi3Config, dict(common, pad_token_id=0)),
        "olmo2": (transformers.Olmo2Config, dict(common, pad_token_id=0)),
        "granite": (transformers.GraniteConfig, common),
        "cohere": (transformers.CohereConfig, dict(common, pad_token_id=0)),
        "stablelm": (transformers.StableLmConfig, common),
        "starcoder2": (transformers.Starcoder2Config, dict(common, sliding_window=8)),
        "gemma3_text": (
            transformers.Gemma3TextConfig,
            dict(
                common,
                head_dim=16,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
            ),
        ),
        "smollm3": (transformers.SmolLM3Config, dict(common, pad_token_id=0)),
        "qwen2_moe": (
            transformers.Qwen2MoeConfig,
            dict(
                moe,
                num_experts=4,
                moe_intermediate_size=48,
                shared_expert_intermediate_size=48,
            ),
        ),
        "opt": (transformers.OPTConfig, opt),
        "falcon": (transformers.FalconConfig, no_kv),
        "gptj": (transformers.GPTJConfig, dict(gpt, rotary_dim=8)),
        "bloom": (
            transformers.BloomConfig,
            dict(vocab_size=300, hidden_size=64, n_layer=2, n_head=4),
        ),
    }
    config_class, kwargs = made[kind]
    return config_class(**kwargs)


def _random_pairs(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(1, 300, (n,), generator=generator).tolist()

    return [{"prompt": ids(p), "chosen": ids(c), "rejected": ids(r)} for p, c, r in lengths]


# (prompt, chosen, rejected) lengths: rows longer than the sliding windows, responses of unequal
# lengths both ways, a one-token prompt and one-token responses.
SHARED_LENGTHS = [(13, 7, 5), (3, 9, 12), (20, 2, 1), (1, 6, 6)]


def _record_randomness(monkeypatch, cuda=False):
    """Draw from torch's and Python's generators (and this GPU's) at every training forward; return
    the draws."""
    real = loss.pair_losses
    draws = []

    def pair_losses(*args, **kwargs):
        if torch.is_grad_enabled():  # a training micro-batch, not evaluation
            cuda_draw = [torch.rand(1, device="cuda").item()] if cuda else []
            draws.append((torch.rand(1).item(), random.random(), *cuda_draw))
        return real(*args, **kwargs)

    monkeypatch.setattr(loss, "pair_losses", pair_losses)
    return draws


# Runs compared with SIX_STEPS use its micro-batch of 8 pairs: the same forward shapes give the same
# rounding.
SIX = ("--max-steps", "6", "--micro-batch-size", "8")


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """An uninterrupted 1-rank run of 6 steps (2 micro-batches each), checkpointed every 2, keeping
    the last 2."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        draws = _record_randomness(monkeypatch)
        out = run(
            tmp_path_factory.mktemp("six"), "run", *SIX, "--save-every", "2", "--keep-last", "2"
        )
    return out, draws


# What two runs of the same training log alike at each step: the pair metrics, and in training the
# gradient norm and the learning rate.
TRAIN_KEYS = (*PAIR_METRICS, "grad_norm", "lr")


def _rounding_bound(key: str, row: dict, beta: float) -> dict:
    """pytest.approx's bounds for `key` of a logged `row` in a run that differs from another only in
    rounding (see LOGP_REL): log-probs relative to themselves, rewards and margins at beta times the
    log-probs' scale, the loss at that scale or RUN_REL of itself, the gradient norm GRAD_NORM_REL
    of itself, the rest RUN_REL."""
    logps = abs(row.get("logps/chosen", 0.0)) + abs(row.get("logps/rejected", 0.0))
    # One reward or margin: beta x a difference of log-probs, each off by LOGP_REL of itself.
    reward = 2 * beta * LOGP_REL * logps
    if key.startswith("logps/"):
        return {"rel": LOGP_REL, "abs": 0}
    if key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        return {"rel": 0, "abs": reward}
    if key == "loss":
        return {"rel": RUN_REL, "abs": reward}
    if key == "grad_norm":
        return {"rel": GRAD_NORM_REL, "abs": 0}
    return {"rel": RUN_REL, "abs": 1e-12}


def _assert_same_rows(rows_a, rows_b, keys=TRAIN_KEYS, exact=False, beta=0.1):
    """The same steps, each with the same `keys`: bit for bit (exact), or as two runs that differ
    only in rounding (_rounding_bound; `beta` the runs' --beta)."""
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b] and rows_a
    for x, y in zip(rows_a, rows_b):
        for key in keys:
            expected = y[key]
            if not exact:
                expected = pytest.approx(y[key], **_rounding_bound(key, y, beta))
            assert x[key] == expected, (x["step"], key)


def _assert_same_run(a, b, exact=True, keys=PAIR_METRICS, weight_atol=ADAM_ATOL):
    """Same per-step train and eval metrics (`keys`; in training also the gradient norm and the
    learning rate) and the same exported tensors: bit for bit, or metrics as runs alike up to
    rounding (_rounding_bound) and weights within weight_atol."""
    assert [r["step"] for r in read_metrics(a)] == list(range(1, len(read_metrics(a)) + 1))
    _assert_same_rows(read_metrics(a), read_metrics(b), [*keys, "grad_norm", "lr"], exact)
    evals_a = read_metrics(a, "eval")
    evals_b = read_metrics(b, "eval")
    # A resumed run has no step-0 evaluation.
    if (evals_a[0]["step"] == 0) != (evals_b[0]["step"] == 0):
        evals_a = [r for r in evals_a if r["step"]]
        evals_b = [r for r in evals_b if r["step"]]
    _assert_same_rows(evals_a, evals_b, keys, exact)
    wa, wb = load_safetensors(os.path.join(a, "final")), load_safetensors(os.path.join(b, "final"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0 if exact else weight_atol)


# Every option of the objective at once (f-DPO allows this mix), TR-DPO syncing every 2 of 4 steps.
OBJECTIVES = (
    "--loss",
    "dpo",
    "--loss",
    "ipo",
    "--loss-weights",
    "1",
    "--loss-weights",
    "0.5",
    "--use-weighting",
    "--ld-alpha",
    "0.5",
    "--f-divergence-type",
    "js_divergence",
    "--sync-ref-model",
    "--ref-model-sync-steps",
    "2",
    "--ref-model-mixup-alpha",
    "0.6",
    "--max-steps",
    "4",
    "--micro-batch-size",
    "8",
)


@pytest.fixture(scope="module")
def objectives_run(tmp_path_factory):
    """A 1-rank run with OBJECTIVES, checkpointed every 2 steps (all kept)."""
    return run(tmp_path_factory.mktemp("objectives"), "run", *OBJECTIVES, "--save-every", "2")


@pytest.fixture(scope="module")
def two_ranks(background):
    """Sixteen runs in one start of two ranks (torchrun_runs: Background's "two_ranks"), each
    checked by its own test.
    "resumed": six_steps's step-4 checkpoint, copied as its latest, resumed (--resume latest) with
    micro-batches of 2 (4 a step and rank),
    tokenizing into an empty cache; "offload": the same with --cpu-offload (and activation
    checkpointing), saving every step; "eval": EVAL_ARGS; "lora": REF_DATA with REF_LORA, offloaded;
    "wandb": a W&B project whose wandb.init fails (FAILING_WANDB); "objectives": OBJECTIVES;
    "oracle": ORACLE_ARGS; "krows": one step over the K-response file (k_step_args); "kto": one
    step of --loss kto over the unpaired file (kto_file); each of
    CONVERTED: converted_args; then three scripts' runs, each patching only itself: "fp16":
    FP16_OVERFLOW under INJECT; "preempted": SIX under PREEMPT; "generation": LOCKSTEP's and
    GATHERS's checks; "rows": generate.py's round 1 of the on-policy test (onpolicy_args);
    "failed_plan": two steps whose first-step memory check fails on rank 1 (FAILED_PLAN). Returns
    ({name: out_dir}, stderr of all)."""
    outs, proc = background.result("two_ranks")
    # The failing W&B run and the scripts' runs: their tests read their records.
    ended = set(outs) - {"wandb", "fp16", "preempted", "generation", "rows"}
    assert_runs_ended(proc, [outs[name] for name in ended], 2)
    return outs, proc.stderr


def start_two_ranks(request, folder):
    """Background's start of two_ranks: six_steps's checkpoint copied, the scripts written."""
    six_steps = request.getfixturevalue("six_steps")
    k_files = request.getfixturevalue("k_files")
    kto_file = request.getfixturevalue("kto_file")
    names = ("resumed", "offload", "eval", "lora", "wandb", "objectives", "oracle", "krows", "kto")
    names += (*CONVERTED, "fp16", "preempted", "generation", "rows", "failed_plan")
    outs = {name: folder / name for name in names}
    resume = os.path.join(six_steps[0], "checkpoints", "step-4")
    # "resumed" finds six_steps's step 4 as its own latest checkpoint.
    shutil.copytree(resume, outs["resumed"] / "checkpoints" / "step-4")
    (outs["resumed"] / "checkpoints" / "latest").write_text("step-4")
    (folder / "fake").mkdir()
    (folder / "fake" / "wandb.py").write_text(FAILING_WANDB)
    scripts = {"inject": INJECT, "preempt": PREEMPT, "generation": LOCKSTEP + GATHERS}
    scripts["failed_plan"] = FAILED_PLAN
    for name, text in scripts.items():
        (folder / f"{name}.py").write_text(text)
    runs = [
        trainer_args(
            outs["resumed"],
            "--max-steps",
            "6",
            "--micro-batch-size",
            "2",
            "--resume",
            "latest",
            "--cache-dir",
            str(folder / "cache"),
        ),
        trainer_args(
            outs["offload"],
            "--max-steps",
            "6",
            "--micro-batch-size",
            "2",
            "--resume",
            resume,
            "--cpu-offload",
            "--activation-checkpointing",
            "--save-every",
            "1",
        ),
        trainer_args(outs["eval"], *EVAL_ARGS),
        trainer_args(
            outs["lora"],
            *REF_DATA,
            *REF_LORA,
            "--cpu-offload",
            "--cache-dir",
            str(folder / "ref-cache"),
        ),
        trainer_args(outs["wandb"], "--max-steps", "2", "--wandb-project", "p"),
        trainer_args(outs["objectives"], *OBJECTIVES),
        trainer_args(outs["oracle"], *ORACLE_ARGS),
        trainer_args(outs["krows"], *k_step_args(k_files[0], len(K_ROWS))),
        trainer_args(
            outs["kto"],
            *kto_step_args(kto_file),
            *("--ref", "precompute", "--no-share-prompt", "--cache-dir", str(folder / "kto")),
        ),
        *[trainer_args(outs[kind], *converted_args(kind)) for kind in CONVERTED],
        {
            "argv": trainer_args(outs["fp16"], *FP16_OVERFLOW),
            "script": str(folder / "inject.py"),
        },
        {"argv": trainer_args(outs["preempted"], *SIX), "script": str(folder / "preempt.py")},
        {
            "argv": ["--out-dir", str(outs["generation"])],
            "script": str(folder / "generation.py"),
        },
        {"argv": onpolicy_args(folder, outs["rows"]), "script": GENERATE},
        {
            "argv": trainer_args(outs["failed_plan"], "--max-steps", "2"),
            "script": str(folder / "failed_plan.py"),
        },
    ]
    return run_ranks, 2, outs, runs, [str(folder / "fake")]


@pytest.fixture(scope="module")
def processes(background):
    """The runs that must each be a process of their own, started together (Background's
    "processes"): "sigusr1": a run of 200 steps saving in the background, sent SIGUSR1 (SLURM's
    warning before the time limit) once steps 1-2 are logged; "killed": SIX saving every 2 steps in
    the background under KILL_MID_SAVE; "bad": train_dpo.py given a file with BAD_ROW. Returns
    {name: (out_dir, exit code, stderr)} and the seconds from the signal to sigusr1's exit."""
    return background.result("processes")


def start_processes(request, folder):
    """Background's start of processes."""
    (folder / "kill.py").write_text(KILL_MID_SAVE)
    (folder / "bad.jsonl").write_text(BAD_ROW)
    trainer = os.path.join(HERE, "train_dpo.py")
    commands = {
        # The stop waits for the write.
        "sigusr1": [
            trainer,
            *trainer_args(folder / "sigusr1", "--max-steps", "200", "--async-save"),
        ],
        "killed": [
            folder / "kill.py",
            *trainer_args(folder / "killed", *SIX, "--save-every", "2", "--async-save"),
        ],
        "bad": [trainer, "--out-dir", folder / "bad", *ON_CPU, "--data", folder / "bad.jsonl"],
    }
    return _run_processes, folder, commands


def _run_processes(folder, commands):
    procs = {}
    for name, cmd in commands.items():
        with open(folder / f"{name}.err", "w") as err:
            procs[name] = subprocess.Popen(
                [sys.executable, *map(str, cmd)],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=SUBPROCESS_ENV,
            )
    try:
        metrics = folder / "sigusr1" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        # until the two data rows and steps 1-2 are logged
        while (
            not (metrics.exists() and metrics.read_text().count("\n") >= 4)
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        sent = time.monotonic()
        procs["sigusr1"].send_signal(signal.SIGUSR1)
        procs["sigusr1"].wait(timeout=60)
        waited = time.monotonic() - sent
        for proc in procs.values():
            proc.wait(timeout=300)
    finally:
        for proc in procs.values():
            proc.kill()  # none left behind, whatever failed
    results = {
        name: (folder / name, proc.returncode, (folder / f"{name}.err").read_text())
        for name, proc in procs.items()
    }
    return results, waited


def _hf_export_names():
    """The tensor names Hugging Face's own save_pretrained writes for the tiny model (tied: no
    lm_head.weight)."""
    model, _ = tiny(seed=0)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        return set(load_safetensors(folder))


LORA = ("--lora-rank", "8", "--lora-alpha", "16")  # scale alpha / rank = 2


def _demo_k_rows(n, seed=0):
    """n rows of the demo's prompts, each with 2 to 5 of the demo's responses (its other rows'),
    scored 0 to 3 with ties, at least two scores apart."""
    rng = random.Random(seed)
    pool = sorted({p[key] for p in demo_pairs("train")[:200] for key in ("chosen", "rejected")})
    rows = []
    for i, pair in enumerate(demo_pairs("train")[:n]):
        k = 2 + i % 4
        scores = [rng.randint(0, 3) for _ in range(k)]
        if len(set(scores)) < 2:
            scores[0] = (scores[1] + 1) % 4
        rows.append({"prompt": pair["prompt"], "responses": rng.sample(pool, k), "scores": scores})
    return rows


def _pair_file(rows, pairs="all"):
    return [
        {"prompt": r["prompt"], "chosen": r["responses"][i], "rejected": r["responses"][j]}
        for r in rows
        for i, j in row_pairs([float(s) for s in r["scores"]], pairs)
    ]


K_ROWS = _demo_k_rows(24)
K_PAIRS = _pair_file(K_ROWS)


@pytest.fixture(scope="module")
def k_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k")
    return (
        write_jsonl(str(folder / "k.jsonl"), K_ROWS),
        write_jsonl(str(folder / "pairs.jsonl"), K_PAIRS),
    )


@pytest.fixture(scope="module", autouse=True)
def background(request, tmp_path_factory):
    """Background's runs, started as the module's tests begin, in the order the tests read them,
    each where a selected test needs it."""
    starts = {
        "two_ranks": start_two_ranks,
        "hsdp_runs": start_hsdp_runs,
        "processes": start_processes,
        "packed_grid": start_packed_grid,
        "packed_ranks": start_packed_ranks,
        "onpolicy": start_onpolicy,
        "compiled_runs": start_compiled_runs,
        "stalled": start_stalled,
        "imports": start_imports,
    }
    runs = Background(request, tmp_path_factory, starts)
    wanted = {name for item in request.session.items for name in item.fixturenames}
    for name in starts:
        if name in wanted:
            runs.start(name)
    yield runs
    runs.close()


def _kto_rows(n):
    """n demo prompts as TRL's unpaired rows: every third prompt's two reviews on adjacent lines
    (praise desirable, criticism not), the others' one review, its label alternating; one prompt
    repeated far from its first line, to be shared with it."""
    rows = []
    distinct = {pair["prompt"]: pair for pair in demo_pairs("train")}
    for i, pair in enumerate(list(distinct.values())[:n]):
        sides = ("chosen", "rejected") if i % 3 == 0 else (("chosen", "rejected")[i % 2],)
        rows += [
            {"prompt": pair["prompt"], "completion": pair[s], "label": s == "chosen"} for s in sides
        ]
    first = rows[0]
    return rows + [{**first, "completion": first["completion"] + " Again.", "label": False}]


KTO_ROWS = _kto_rows(20)


@pytest.fixture(scope="module")
def kto_file(tmp_path_factory):
    return write_jsonl(str(tmp_path_factory.mktemp("kto") / "kto.jsonl"), KTO_ROWS)


# ------------------------------------------------------------------------------------- precision.py
# Precision names and policies; bf16 and fp16 runs, float32 masters, overflow and NaN skips.


def test_precision_names_and_errors():
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        p = resolve_precision(PrecisionConfig(name), CPU)
        assert p.compute_dtype == dtype and p.mp_policy.param_dtype == dtype
        assert p.mp_policy.reduce_dtype == torch.float32 and p.scaler.is_enabled() == (
            name == "fp16"
        )
    assert (
        resolve_precision(PrecisionConfig("auto"), CPU).name == "fp32"
    )  # bf16 only on a CUDA device that supports it
    # fp16 on a CPU is what was asked for, with a line saying so.
    assert resolve_precision(PrecisionConfig("auto"), CPU).warning is None
    assert resolve_precision(PrecisionConfig("fp16"), CPU).warning == (
        "--precision fp16 on a CPU: float16 compute with a dynamic loss scaler, as on a GPU; auto "
        "would pick fp32 here"
    )
    with pytest.raises(ValueError, match="fp32, bf16, fp16"):
        resolve_precision(PrecisionConfig("fp8"), CPU)


def test_bf16_on_a_cpu_without_native_bf16_is_never_automatic_and_warns_once(
    tmp_path, monkeypatch, capsys
):
    cpuinfo = {
        "avx2": (
            "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\n"
            "processor\t: 1\nflags\t\t: fpu avx2\n"
        ),
        "amx": "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n",
        "arm": "Features\t: fp asimd bf16\n",
    }
    for name, text in cpuinfo.items():
        (tmp_path / name).write_text(text)
    found = {
        name: precision.cpu_has_native_bf16(str(tmp_path / name)) for name in [*cpuinfo, "absent"]
    }
    assert found == {"avx2": False, "amx": True, "arm": True, "absent": None}
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)  # an AVX2-only CPU
    auto = resolve_precision(PrecisionConfig("auto"), CPU)
    assert auto.name == "fp32" and auto.warning is None
    assert "no native bfloat16" in resolve_precision(PrecisionConfig("bf16"), CPU).warning
    run(
        tmp_path, "slow", "--precision", "bf16", "--max-steps", "1", "--batch-size", "4"
    )  # it trains, saying why slow
    err = capsys.readouterr().err
    assert err.count("warning: --precision bf16: this CPU has no native bfloat16") == 1
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert resolve_precision(PrecisionConfig("bf16"), CPU).warning is None


def test_auto_skips_gpus_that_only_emulate_bf16(monkeypatch):
    # A V100 or T4: torch.cuda.is_bf16_supported() says yes by default, counting slow emulation.
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    gpu = torch.device("cuda", 0)
    assert resolve_precision(PrecisionConfig("auto"), gpu).name == "fp32"
    with pytest.raises(ValueError, match="32GB has no native bfloat16; choose fp16 or fp32"):
        resolve_precision(PrecisionConfig("bf16"), gpu)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: True
    )  # an A100 or H100
    assert resolve_precision(PrecisionConfig("auto"), gpu).name == "bf16"


def test_reduce_dtype_flag(tmp_path, capsys):
    assert (
        resolve_precision(PrecisionConfig("bf16", reduce_dtype="bf16"), CPU).mp_policy.reduce_dtype
        == torch.bfloat16
    )
    with pytest.raises(ValueError, match="needs --precision bf16"):
        resolve_precision(PrecisionConfig("fp32", reduce_dtype="bf16"), CPU)
    # Unsharded accumulation would add the micro-batches' gradients in bf16: refused, before
    # anything is written.
    with pytest.raises(SystemExit) as exit_info:
        run(
            tmp_path,
            "run",
            "--precision",
            "bf16",
            "--reduce-dtype",
            "bf16",
            "--unsharded-grad-accumulation",
        )
    err = capsys.readouterr().err
    assert (
        exit_info.value.code == 2
        and "error: --unsharded-grad-accumulation sums micro-batch gradients" in err
    )
    assert not (tmp_path / "run").exists()


def test_bf16_keeps_float32_masters_grads_optimizer_state_and_loss():
    with world_of_one():
        policy, _, tok = sharded_tiny(seed=4, precision="bf16")
        reference, _, _ = sharded_tiny(seed=4, precision="bf16", frozen=True)
        assert all(p.dtype == torch.float32 and p.requires_grad for p in policy.parameters())
        assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
        # The frozen reference is stored in bf16 (no float32 copy), and computes exactly what the
        # policy does.
        assert all(p.dtype == torch.bfloat16 for p in reference.parameters())
        ids = torch.randint(0, 256, (2, 12))
        with torch.no_grad():
            torch.testing.assert_close(
                reference(input_ids=ids).logits, policy(input_ids=ids).logits, rtol=0, atol=0
            )
        policy.reshard()
        pairs = tokenize(demo_pairs("train")[:2], tok, 64, 32)
        batch = collate_pairs(pairs, tok.pad_token_id)
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        assert logits.dtype == torch.bfloat16
        out = forward_pairs(policy, reference, batch, LossConfig())
        values = (out.losses, out.chosen_rewards, out.rejected_rewards, out.chosen_logps)
        assert all(v.dtype == torch.float32 for v in values)
        loss = out.losses.mean() - out.chosen_logps.sum() * 0  # the loss itself is float32
        (loss - sequence_logps(logits, hf_labels(batch, pairs)).mean()).backward()
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        optimizer.step()
        assert all(p.grad.dtype == torch.float32 for p in policy.parameters())
        states = [t for st in optimizer.state.values() for k, t in st.items() if k != "step"]
        assert len(states) == 2 * len(list(policy.parameters())) and all(
            t.dtype == torch.float32 for t in states
        )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda_bf16)])
def test_bf16_training_matches_the_fp32_cpu_run_within_bf16_tolerance(tmp_path, device):
    # Few pairs: a CPU without native bf16 emulates it.
    six = ("--max-steps", "6", "--batch-size", "4")
    oracle = run(tmp_path, "fp32", *six)
    bf16 = run(tmp_path, "bf16", *six, "--precision", "bf16", device=device)
    # Bounds from bf16's rounding (FSDP2 keeps float32 masters, gradients and optimizer state, and
    # loss.py computes in float32). A token's log-prob (about -5.6, the log of the vocabulary) moves
    # by its logit's and the log-sum-exp's rounding, half of BF16_EPS of logits of order 1: a
    # quarter of BF16_EPS of itself, and of the sum. A margin is beta times the difference of four
    # such sums, whose errors (the same tokens, nearly the same weights, the same precision) mostly
    # cancel: one sum's bound; the loss, of slope under 1 in it, the same. The gradient norm: each
    # gradient from activations rounded at each of the 4 layers, forward and back, by up to half of
    # BF16_EPS: 4 BF16_EPS.
    logp_rel = BF16_EPS / 4
    for split in ("train", "eval"):
        for a, b in zip(read_metrics(oracle, split), read_metrics(bf16, split), strict=True):
            margin = 0.1 * logp_rel * abs(a["logps/chosen"])
            assert a["step"] == b["step"] and b["loss"] == pytest.approx(a["loss"], abs=margin)
            assert b["rewards/margins"] == pytest.approx(a["rewards/margins"], abs=margin)
            for key in ("logps/chosen", "logps/rejected"):
                assert b[key] == pytest.approx(a[key], rel=logp_rel)
            if split == "train":
                assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=4 * BF16_EPS)
    wa = load_safetensors(os.path.join(oracle, "final"))
    wb = load_safetensors(os.path.join(bf16, "final"))
    # The float32 masters are exported.
    assert wa.keys() == wb.keys() and all(wb[k].dtype == torch.float32 for k in wb)
    # Against the size of the update (6 Adam steps move every weight by about lr each), not of the
    # weights: a tenth of it, as ADAM_ATOL is of one step's lr (where a gradient is near 0, Adam
    # moves the weight by a share of lr that the rounding decides).
    before = tiny_model(tiny_config()[0], seed=0).state_dict()
    difference = sum((wa[k] - wb[k]).double().square().sum() for k in wa) ** 0.5
    update = sum((wa[k] - before[k]).double().square().sum() for k in wa) ** 0.5
    assert difference < 0.1 * update, (difference, update)


INJECT = """
import json, os, sys
from unittest import mock
import torch
import fsdp_setup, train_dpo
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
record, unscale = [], torch.amp.GradScaler.unscale_

def unscale_(self, optimizer):
    params = [p for group in optimizer.param_groups for p in group["params"]]
    checksum = sum(p.to_local().double().sum().item() for p in params)
    record.append({"scale": self.get_scale(), "checksum": checksum})
    # an overflow in the last rank's gradient shard only, at step 3
    if len(record) == 3 and rank == world - 1:
        grad = next(p.grad for p in params if p.grad.to_local().numel())
        grad.to_local().view(-1)[0] = float("inf")
    return unscale(self, optimizer)

def main(argv):  # patched for this run alone; each rank's record in its --out-dir
    try:
        with mock.patch.object(torch.amp.GradScaler, "unscale_", unscale_):
            train_dpo.main(argv)
    finally:
        out = argv[argv.index("--out-dir") + 1]
        with open(os.path.join(out, f"record-{rank}.json"), "w") as f:
            json.dump(record, f)

if __name__ == "__main__":  # a start of its own
    main(sys.argv[1:])
    fsdp_setup.exit_without_shutdown(0)
"""
FP16_OVERFLOW = ("--batch-size", "4", "--max-steps", "4", "--precision", "fp16")


def _poison(monkeypatch, bad_calls):
    """Make the trainer's forward return NaN losses on the given (1-based) training forward
    calls."""
    real = loss.pair_losses
    calls = [0]

    def pair_losses(*args, **kwargs):
        out = real(*args, **kwargs)
        if torch.is_grad_enabled():  # a training micro-batch, not evaluation
            calls[0] += 1
            if calls[0] in bad_calls:
                out.losses = out.losses * float("nan")
        return out

    monkeypatch.setattr(loss, "pair_losses", pair_losses)


def test_nan_loss_skips_the_step_and_repeated_nans_stop_the_run(tmp_path, monkeypatch, capsys):
    one_step = run(tmp_path, "one", "--max-steps", "1")
    _poison(monkeypatch, bad_calls={2})
    poisoned = run(tmp_path, "poisoned", "--max-steps", "2")
    assert [r["skipped"] for r in read_metrics(poisoned)] == [False, True]
    wa, wb = (
        load_safetensors(os.path.join(one_step, "final")),
        load_safetensors(os.path.join(poisoned, "final")),
    )
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # the NaN step changed nothing
    _poison(monkeypatch, bad_calls=set(range(2, 100)))
    with pytest.raises(SystemExit) as exit_info:
        run(tmp_path, "stopped", "--max-steps", "10", "--max-skipped-steps", "3")
    assert exit_info.value.code == 1
    assert (
        "error: stopping at step 4: 3 consecutive steps since step 2 had a non-finite"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "stopped" / "final").exists()


def test_fp16_overflows_with_a_finite_loss_do_not_count_toward_max_skipped_steps(
    tmp_path, monkeypatch, capsys
):
    # From the default scale of 2**16 the first step overflows: the scaler finding its scale, not a
    # broken run.
    # Emulated on a CPU: few pairs. Separate rows: the first batch whose gradients overflow there.
    small = ("--precision", "fp16", "--batch-size", "4", "--no-share-prompt")
    out = run(tmp_path, "fp16", *small, "--max-steps", "2", "--max-skipped-steps", "1")
    rows = read_metrics(out)
    assert rows[0]["skipped"] and rows[0]["loss_scale"] == 2.0**15 and not rows[1]["skipped"]
    _poison(monkeypatch, bad_calls={2})  # a non-finite loss still counts (one forward a step here)
    with pytest.raises(SystemExit) as exit_info:
        run(tmp_path, "nan", *small, "--max-steps", "3", "--max-skipped-steps", "1")
    assert exit_info.value.code == 1 and "error: stopping at step 2" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ fsdp_setup.py
# Process groups and devices, sharded builds and their rows, checkpointed blocks, offload, HSDP.


def test_each_rank_reads_the_rows_fsdp2_gives_it_uneven_and_hsdp_too():
    """fsdp_setup._local_rows against torch.chunk, which FSDP2 shards dim 0 with (the last ranks may
    get fewer rows or none), on an FSDP mesh and on HSDP's (replicas, shards) one, whose replicas
    hold the same rows."""
    from types import SimpleNamespace
    from torch.distributed.tensor import Replicate, Shard

    for rows, shards in ((10, 4), (5, 4), (3, 4), (8, 2), (7, 1)):
        for replica in (None, 0, 1):
            for rank in range(shards):
                sizes = (shards,) if replica is None else (2, shards)
                coords = (rank,) if replica is None else (replica, rank)
                mesh = SimpleNamespace(size=sizes.__getitem__, get_local_rank=coords.__getitem__)
                placements = (Shard(0),) if replica is None else (Replicate(), Shard(0))
                param = SimpleNamespace(placements=placements, device_mesh=mesh, shape=(rows, 3))
                expected = list(torch.arange(rows).chunk(shards)) + [torch.arange(0)] * shards
                assert torch.equal(
                    torch.arange(rows)[fsdp_setup._local_rows(param)], expected[rank]
                )
    assert fsdp_setup._local_rows(torch.zeros(4, 2)) == slice(None)  # not sharded: every row


def test_deterministic_turns_on_deterministic_kernels_and_cublas_workspace_and_off_again(
    monkeypatch,
):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    for deterministic in (True, False):
        fsdp_setup.init_distributed("cpu", deterministic=deterministic)
        try:
            assert torch.are_deterministic_algorithms_enabled() is deterministic
        finally:
            dist.destroy_process_group()
        # cuBLAS reads it when CUDA starts: set by the first, left by the second.
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    # The flag reaches init_distributed (which here stops the run at once).
    seen = []

    def init_distributed(*args, deterministic, fake_world):
        seen.append((deterministic, fake_world))
        raise ValueError("stop")

    monkeypatch.setattr(fsdp_setup, "init_distributed", init_distributed)
    with pytest.raises(SystemExit):
        train_dpo.main(["--deterministic", "--no-warm-start"])
    # A training run's world is a real one: no fake world of --plan's.
    assert seen == [(True, 0)]


def test_each_process_takes_its_own_gpu_however_many_it_sees(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for visible, local_rank, shown, expected in (
        (8, 3, "", 3),
        (4, 0, "", 0),
        (1, 0, "", 0),
        (1, 3, "5", 0),
    ):
        monkeypatch.setattr(torch.cuda, "device_count", lambda visible=visible: visible)
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setenv(
            "CUDA_VISIBLE_DEVICES", shown
        )  # "5": a launcher showed this process GPU 5 alone
        assert fsdp_setup._local_gpu() == expected
    for visible, local_rank in ((2, 5), (1, 1)):  # (1, 1): two processes on a one-GPU machine
        monkeypatch.setattr(torch.cuda, "device_count", lambda visible=visible: visible)
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        with pytest.raises(
            ValueError, match=f"LOCAL_RANK {local_rank} but this process sees only {visible} GPUs"
        ):
            fsdp_setup._local_gpu()
    if not GPUS:
        with pytest.raises(ValueError, match="--device cuda: no CUDA device is visible"):
            fsdp_setup.init_distributed("cuda")


def test_meta_device_build_loads_the_weights_buffers_and_tie_exactly():
    with world_of_one():
        model, full, tok = sharded_tiny(seed=7)
        assert (
            model.lm_head.weight is model.model.embed_tokens.weight
        )  # the tie survives meta init and sharding
        for (
            name,
            buf,
        ) in full.named_buffers():  # incl. non-persistent rotary inv_freq, absent from state dicts
            torch.testing.assert_close(model.get_buffer(name), buf, rtol=0, atol=0)
        batch = collate_pairs(tokenize(demo_pairs("train")[:3], tok, 64, 32), tok.pad_token_id)
        with torch.no_grad():
            inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
            torch.testing.assert_close(
                model(**inputs).logits, full(**inputs).logits, rtol=0, atol=0
            )
        state = full_state(model)
    for k, v in full.state_dict().items():
        assert k == "lm_head.weight" or torch.equal(state[k], v), k


def test_activation_checkpointing_and_resharding_change_memory_not_math():
    results = []
    for fsdp in ({}, {"activation_checkpointing": True}, {"reshard_after_forward": False}):
        with world_of_one():
            model, _, tok = sharded_tiny(seed=6, **fsdp)
            counts = {"mlp": 0, "saved": 0}

            def counted(forward, counts=counts):
                def wrapper(*args, **kwargs):
                    counts["mlp"] += 1
                    return forward(*args, **kwargs)

                return wrapper

            for layer in model.model.layers:
                layer.mlp.forward = counted(layer.mlp.forward)
            pairs = tokenize(demo_pairs("train")[:2], tok, 64, 32)
            batch = collate_pairs(pairs, tok.pad_token_id)

            def pack(t, counts=counts):
                counts["saved"] += 1
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logits = model(input_ids=batch.input_ids, use_cache=False).logits
            values = sequence_logps(logits, hf_labels(batch, pairs))
            values.sum().backward()
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            results.append((values.detach(), grads, counts))
    layers = len(model.model.layers)
    # Checkpointing runs every block's forward again in backward, and keeps far fewer tensors for
    # it.
    assert [r[2]["mlp"] for r in results] == [layers, 2 * layers, layers]
    assert results[1][2]["saved"] < results[0][2]["saved"] / 4
    for values, grads, _ in results[1:]:
        torch.testing.assert_close(values, results[0][0], rtol=0, atol=0)
        # The same kernels on the same shapes: at most a few float32 roundings (F32_REL) in the
        # order backward adds the recomputed blocks' gradients up.
        _assert_close_at_scale(list(grads.values()), [results[0][1][n] for n in grads], F32_REL)


def test_a_frozen_reference_reshards_even_with_no_reshard_after_forward():
    from torch.distributed.tensor import DTensor

    with world_of_one():
        policy, _, tok = sharded_tiny(seed=2, reshard_after_forward=False)
        reference, _, _ = sharded_tiny(seed=2, frozen=True, reshard_after_forward=False)
        batch = collate_pairs(tokenize(demo_pairs("train")[:2], tok, 64, 32), tok.pad_token_id)
        inputs = {"input_ids": batch.input_ids}
        with torch.no_grad():
            reference(**inputs)
        policy(**inputs)
        # FSDP2 swaps a module's sharded DTensor parameters for plain gathered tensors while it is
        # unsharded. The policy's blocks stay gathered for the backward that follows (ZeRO-2); the
        # reference has none, so its blocks must be sharded again, or every rank would hold the
        # whole reference.
        assert not any(isinstance(p, DTensor) for p in policy.model.layers.parameters())
        assert all(isinstance(p, DTensor) for p in reference.parameters())


def test_gradient_accumulation_keeps_only_gradient_shards_unless_asked(tmp_path, monkeypatch):
    held = []
    real = train_dpo.micro_batch_loss

    def micro_batch_loss(objective, policy, *args):  # at each micro-batch: is there a p.grad yet?
        if torch.is_grad_enabled():  # a training forward, not evaluation
            held.append({p.grad is not None for p in policy.parameters()})
        return real(objective, policy, *args)

    monkeypatch.setattr(train_dpo, "micro_batch_loss", micro_batch_loss)
    args = ("--max-steps", "2", "--micro-batch-size", "8")  # 2 micro-batches a step
    sharded = run(tmp_path, "sharded", *args)
    unsharded = run(tmp_path, "unsharded", *args, "--unsharded-grad-accumulation")
    # By default micro-batch 1's gradient is reduce-scattered at once: micro-batch 2 finds it in
    # p.grad, as a shard, and FSDP has freed the full one. Asked for unsharded accumulation, FSDP
    # holds the full gradient itself until the step's last micro-batch, and p.grad is still empty at
    # micro-batch 2.
    assert held == [{False}, {True}] * 2 + [{False}, {False}] * 2
    _assert_same_run(sharded, unsharded, exact=False)  # the same training either way


def test_activation_checkpointing_fails_loudly_without_blocks():
    def make_model():
        return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())

    config = FSDPConfig(activation_checkpointing=True)
    with pytest.raises(ValueError, match="no transformer block"):
        fsdp_setup.build_sharded(make_model, None, MixedPrecisionPolicy(), CPU, config)


def test_find_block_class_without_no_split_modules():
    class Block(torch.nn.Linear):
        pass

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.ModuleList([torch.nn.ReLU()])
            self.layers = torch.nn.ModuleList([Block(2, 2) for _ in range(3)])

    assert find_block_class(Net()) is Block
    with pytest.raises(ValueError, match="no transformer block"):
        find_block_class(torch.nn.Linear(2, 2))


def start_hsdp_runs(request, folder):
    """Background's "hsdp_runs": on four ranks, 6 steps as 2 replicas of 2 shards ("hsdp"), then
    as FSDP from its step-4 checkpoint ("fsdp": 2x2 -> 4)."""
    outs = {"hsdp": folder / "hsdp", "fsdp": folder / "fsdp"}
    four = ("--max-steps", "6", "--micro-batch-size", "4")
    resume = outs["hsdp"] / "checkpoints" / "step-4"
    runs = [
        trainer_args(outs["hsdp"], *four, "--replicas", "2", "--save-every", "4"),
        trainer_args(outs["fsdp"], *four, "--resume", str(resume)),
    ]
    return run_ranks, 4, outs, runs


@pytest.fixture(scope="module")
def hsdp_runs(background):
    return background.result("hsdp_runs")


# ------------------------------------------------------------------------------------------ data.py
# Reading, rendering and tokenizing rows of every shape, the cache and the inspector.


def test_truncation_keeps_prompt_end_then_cuts_responses():
    _, tok = tiny(seed=0)

    def ids(s):
        return [b + 3 for b in s.encode()]  # ByT5: one token per byte, offset by 3 specials

    eos = tok.eos_token_id
    fits, long_prompt, long_both = tokenize(
        [
            {"prompt": "abcd", "chosen": "xyz", "rejected": "q"},  # 4 + 4 <= 12: untouched
            {
                "prompt": "0123456789",
                "chosen": "xy",
                "rejected": "q",
            },  # 10 + 3 > 12: prompt keeps last 5
            {
                "prompt": "0123456789",
                "chosen": "abcdefgh",
                "rejected": "q",
            },  # 5 + 9 > 12: responses cut to 7
        ],
        tok,
        max_length=12,
        max_prompt_length=5,
    )
    assert fits == {
        "prompt": ids("abcd"),
        "chosen": ids("xyz") + [eos],
        "rejected": ids("q") + [eos],
    }
    assert long_prompt == {
        "prompt": ids("56789"),
        "chosen": ids("xy") + [eos],
        "rejected": ids("q") + [eos],
    }
    assert long_both == {
        "prompt": ids("56789"),
        "chosen": ids("abcdefg"),
        "rejected": ids("q") + [eos],
    }
    # A tokenizer that adds BOS keeps it through truncation, and it counts towards
    # max_prompt_length.
    (bos_pair,) = tokenize(
        [{"prompt": "abcdefgh", "chosen": "xyz", "rejected": "x"}],
        _bos_tokenizer(),
        max_length=8,
        max_prompt_length=4,
    )

    def letters(s):
        return [ord(c) - ord("a") + 3 for c in s]

    assert bos_pair == {
        "prompt": [1] + letters("fgh"),
        "chosen": letters("xyz") + [2],
        "rejected": letters("x") + [2],
    }


def test_max_prompt_length_follows_max_length_unless_given(tmp_path, capsys):
    assert DataConfig().prompt_limit == 256 and DataConfig(max_length=40).prompt_limit == 20
    assert DataConfig(max_length=40, max_prompt_length=30).prompt_limit == 30
    path = _write_jsonl(
        tmp_path / "p.jsonl", demo_pairs("train")[:16]
    )  # prompts of 20-28 bytes, responses ~50
    data.inspect(
        [path, "--model", "tiny", "--max-length", "40", "--show", "16"]
    )  # no --max-prompt-length
    *shown, summary = capsys.readouterr().out.splitlines()
    _, tok = tiny(seed=0)
    prompts = [
        len(tok(json.loads(line)["prompt"], add_special_tokens=False)["input_ids"])
        for line in shown
    ]
    assert max(prompts) == 20 and json.loads(summary)["truncated_prompts"] > 0
    out = run(
        tmp_path,
        "short",
        "--data",
        path,
        "--batch-size",
        "8",
        "--max-length",
        "40",
        "--max-steps",
        "1",
    )
    assert len(read_metrics(out)) == 1
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # an explicit bad pair: one line, no traceback
        train_dpo.main(
            [
                "--max-length",
                "40",
                "--max-prompt-length",
                "40",
                "--out-dir",
                str(tmp_path / "x"),
                *ON_CPU,
            ]
        )
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err == (
        "error: need 0 < --max-prompt-length (40) < --max-length (40), so every response keeps at "
        "least one token"
    )


def test_json_lines_and_json_array_load_the_same_pairs(tmp_path):
    rows = [
        {"prompt": "p1", "chosen": "c1", "rejected": "r1", "extra": 1},
        {"prompt": "p2", "chosen": "c2", "rejected": "r2"},
    ]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "b.json").write_text(json.dumps(rows, indent=2))
    expected = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows]

    def strip(rows):
        return [as_pair(r) for r in rows]

    a, b = read_rows(str(tmp_path / "a.jsonl")), read_rows(str(tmp_path / "b.json"))
    assert strip(a) == expected == strip(b)
    assert [r["where"] for r in a] == [f"{tmp_path / 'a.jsonl'}:1", f"{tmp_path / 'a.jsonl'}:2"]
    # A JSON array's rows by index (from 1), as a hub dataset's.
    assert [r["where"] for r in b] == [f"{tmp_path / 'b.json'} row {i}" for i in (1, 2)]


def _bpe_tokenizer():
    """A fast BPE tokenizer over a, b, c, x, space with one merge: "ab" is a single token."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "a": 2, "b": 3, "c": 4, "x": 5, " ": 6, "ab": 7}
    raw = Tokenizer(models.BPE(vocab, merges=[("a", "b")]))
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", pad_token="<pad>")


def _tokens_of(path, tok, **config):
    tokens, summary = tokenize_rows(read_rows(str(path)), tok, DataConfig(**config))
    return [as_pair(tokens[i]) for i in range(len(tokens))], summary


def test_each_format_gives_the_tokens_generation_sees(tmp_path):
    _, tok = tiny(seed=0)

    def ids(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    eos, user = tok.eos_token_id, [{"role": "user", "content": "Rate the mug"}]
    good, bad = (
        [{"role": "assistant", "content": "Great. 5/5"}],
        [{"role": "assistant", "content": "Bad. 1/5"}],
    )
    chat_prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    assert chat_prompt == "<|user|>\nRate the mug\n<|assistant|>\n"
    expected = {
        "prompt": ids(chat_prompt),
        "chosen": ids("Great. 5/5") + [eos],
        "rejected": ids("Bad. 1/5") + [eos],
    }
    # Conversational, explicit or implicit (the prompt is the shared messages): the prompt ids are
    # exactly the rendered generation prompt; each response keeps the template's own end-of-turn
    # EOS, once.
    explicit = _write_jsonl(
        tmp_path / "conv.jsonl", [{"prompt": user, "chosen": good, "rejected": bad}]
    )
    implicit = _write_jsonl(
        tmp_path / "conv_implicit.jsonl", [{"chosen": user + good, "rejected": user + bad}]
    )
    assert _tokens_of(explicit, tok)[0] == [expected] == _tokens_of(implicit, tok)[0]
    # Standard strings, and implicit strings: Anthropic HH's prompt runs through the last shared
    # "\n\nAssistant:" even when the answers then share a word; a response already ending in EOS
    # gets no second.
    hh = "\n\nHuman: Rate the mug\n\nAssistant:"
    rows = [
        {"prompt": "Rate:", "chosen": " Great</s>", "rejected": " Bad"},
        {"chosen": hh + " Sure, great", "rejected": hh + " Sure, bad"},
        {"chosen": "Rate: Great", "rejected": "Rate: Bad"},
    ]
    standard = _write_jsonl(tmp_path / "std.jsonl", rows[:1])
    implicit = _write_jsonl(tmp_path / "std_implicit.jsonl", rows[1:])
    assert _tokens_of(standard, tok)[0] == [
        {"prompt": ids("Rate:"), "chosen": ids(" Great") + [eos], "rejected": ids(" Bad") + [eos]}
    ]
    assert _tokens_of(implicit, tok)[0] == [
        {
            "prompt": ids(hh),
            "chosen": ids(" Sure, great") + [eos],
            "rejected": ids(" Sure, bad") + [eos],
        },
        {"prompt": ids("Rate: "), "chosen": ids("Great") + [eos], "rejected": ids("Bad") + [eos]},
    ]
    # A tokenizer without a chat template cannot take message lists.
    tok.chat_template = None
    with pytest.raises(DataError, match=r"conv.jsonl:1: message lists need a chat template"):
        _tokens_of(explicit, tok)


def test_implicit_prefix_backs_off_to_a_token_boundary_and_boundary_merges_keep_prompt_ids(
    tmp_path,
):
    tok = _bpe_tokenizer()
    # "xab" and "xac" share "xa", but "ab" is one token: the prompt backs off to "x".
    (pair,), _ = _tokens_of(
        _write_jsonl(tmp_path / "a.jsonl", [{"chosen": "xab", "rejected": "xac"}]), tok
    )
    assert pair == {"prompt": [5], "chosen": [7, 1], "rejected": [2, 4, 1]}
    # An explicit prompt ending in "a" before a response starting with "b": jointly "ab" would
    # swallow the boundary. The prompt keeps its own ids (what generation starts from); that
    # response is tokenized alone.
    path = _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "xa", "chosen": "bc", "rejected": "c"}])
    (pair,), summary = _tokens_of(path, tok)
    assert (
        pair == {"prompt": [5, 2], "chosen": [3, 4, 1], "rejected": [4, 1]}
        and summary["retokenized"] == 1
    )


def test_truncation_modes_and_dropped_pairs_are_counted(tmp_path):
    _, tok = tiny(seed=0)

    def ids(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    eos = tok.eos_token_id
    rows = [
        {"prompt": "0123456789", "chosen": "ab", "rejected": "c"},  # prompt cut to 5, responses fit
        {
            "prompt": "0123456789",
            "chosen": "abcdefgh",
            "rejected": "c",
        },  # prompt cut, then responses to 7
        {"prompt": "p", "chosen": "", "rejected": "x"},  # empty response: dropped
        {"prompt": "p", "chosen": "same", "rejected": "same"},  # identical: dropped
        {"prompt": "abc", "chosen": "x", "rejected": "y"},
    ]  # untouched
    path = _write_jsonl(tmp_path / "t.jsonl", rows)
    end, summary = _tokens_of(path, tok, max_length=12, max_prompt_length=5)
    start, _ = _tokens_of(path, tok, max_length=12, max_prompt_length=5, truncation="keep_start")
    assert [p["prompt"] for p in end] == [ids("56789"), ids("56789"), ids("abc")]
    assert [p["prompt"] for p in start] == [ids("01234"), ids("01234"), ids("abc")]
    assert end[1]["chosen"] == ids("abcdefg") and end[1]["rejected"] == ids("c") + [
        eos
    ]  # cut: no EOS
    assert end[0]["chosen"] == ids("ab") + [eos]
    assert {
        k: summary[k]
        for k in (
            "pairs",
            "dropped",
            "dropped_empty",
            "dropped_identical",
            "truncated",
            "truncated_prompts",
            "truncated_responses",
        )
    } == {
        "pairs": {"all": 3, "best-vs-rest": 3, "best-vs-worst": 3},
        "dropped": 2,
        "dropped_empty": 1,
        "dropped_identical": 1,
        "truncated": 2,
        "truncated_prompts": 2,
        "truncated_responses": 1,
    }
    # Percentiles of the lengths before truncation: prompts of 10, 10 and 3 tokens.
    assert summary["tokens_before_truncation"]["prompt"] == {
        "p50": 10,
        "p90": 10,
        "p99": 10,
        "p100": 10,
    }


def test_pairs_identical_once_truncated_are_dropped_and_counted(tmp_path):
    _, tok = tiny(seed=0)  # one token per byte
    rows = [
        {"prompt": "Q:", "chosen": " same words then good", "rejected": " same words then bad"},
        {"prompt": "Q:", "chosen": " yes", "rejected": " no"},
    ]
    # 14 tokens leave 12 for the responses: " same words t" in both, which then teach nothing.
    tokens, summary = _tokens_of(
        _write_jsonl(tmp_path / "p.jsonl", rows), tok, max_length=14, max_prompt_length=4
    )
    assert [tok.decode(p["chosen"]) for p in tokens] == [" yes</s>"]
    # The row was truncated before its responses came out the same: counted as both.
    assert (
        summary["dropped_identical"],
        summary["identical_after_truncation"],
        summary["truncated"],
    ) == (1, 1, 1)
    # When truncation drops every row, the error says so and names the levers.
    config = DataConfig(
        data=(_write_jsonl(tmp_path / "q.jsonl", rows[:1]),),
        max_length=14,
        max_prompt_length=4,
        cache_dir=str(tmp_path / "cache"),
    )
    with pytest.raises(DataError) as info:
        tokenize_to_cache(config, tok)
    assert str(info.value) == (
        f"{config.data[0]}: every row was dropped: 1 whose responses were identical token for "
        "token; 1 of these only once cut to --max-length 14, the prompt to at most 4 tokens "
        "(--max-prompt-length): raise --max-length, or lower --max-prompt-length to leave the "
        "responses more room"
    )


def test_responses_cut_short_get_no_eos_and_lose_the_missing_eos_penalty(tmp_path, capsys):
    """A row's "cut" marks responses that a length limit stopped: hand-counted, a cut text
    response is its bytes alone and an ended one its bytes and EOS; a cut message-list response
    stops at its content, without the template's end of turn; --missing-eos-penalty lowers a cut
    response's score before the pairs are drawn (here turning a pair around); data.py --show marks
    them. A bad "cut" names the file, line and field."""
    _, tok = tiny(seed=0)
    eos = tok.eos_token_id
    assistant = [{"role": "assistant", "content": "fine"}]
    rows = [
        {"prompt": "Q:", "responses": [" ab", " cd", " ef"], "scores": [1, 1, 0]},
        {"prompt": "Q:", "responses": [" ab", " cd"], "scores": [1, 0], "cut": [True, False]},
        {
            "prompt": [{"role": "user", "content": "hi"}],
            "responses": [assistant, [{"role": "assistant", "content": "no"}]],
            "scores": [1, 0],
            "cut": [True, False],
        },
    ]
    path = _write_jsonl(tmp_path / "cut.jsonl", rows[:2])
    for penalty, scores in ((0.0, [1.0, 0.0]), (2.0, [-1.0, 0.0])):
        tokens, summary = tokenize_rows(
            read_rows(path), tok, DataConfig(missing_eos_penalty=penalty)
        )
        assert tokens[0]["responses"] == [
            [c + 3 for c in b" ab"] + [eos],
            [c + 3 for c in b" cd"] + [eos],
            [c + 3 for c in b" ef"] + [eos],
        ]
        # Cut: " ab" alone, no EOS; ended: " cd" and EOS.
        assert tokens[1]["responses"] == [[c + 3 for c in b" ab"], [c + 3 for c in b" cd"] + [eos]]
        assert tokens[1]["scores"] == scores and summary["cut_responses"] == 1
        # Rows of scores (1, 1, 0) and (1, 0): all gives 2 + 1 pairs, best-vs-rest 1 + 1.
        assert summary["rows"] == 2
        assert summary["pairs"] == {"all": 3, "best-vs-rest": 2, "best-vs-worst": 2}
    # A message-list response, cut: its content, without the template's "</s>\n" after it.
    chat = _write_jsonl(tmp_path / "chat.jsonl", rows[2:])
    tokens, _ = tokenize_rows(read_rows(chat), tok, DataConfig())
    assert [tok.decode(r) for r in tokens[0]["responses"]] == ["fine", "no</s>"]
    data.inspect([path, "--model", "tiny", "--show", "2", "--missing-eos-penalty", "2"])
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "cut" not in shown[0] and shown[1]["cut"] == [True, False]
    assert [r["score"] for r in shown[1]["responses"]] == [-1.0, 0.0]
    # A pair file: the penalty turns a pair around (shown then by score, not as chosen and
    # rejected), or ties it, which drops it.
    pair = _write_jsonl(
        tmp_path / "pair.jsonl",
        [{"prompt": "Q:", "chosen": " ab", "rejected": " cd", "cut": [True, False]}],
    )
    data.inspect([pair, "--model", "tiny", "--show", "1", "--missing-eos-penalty", "2"])
    shown = json.loads(capsys.readouterr().out.splitlines()[0])
    assert [(r["score"], r["text"]) for r in shown["responses"]] == [
        (-1.0, " ab"),
        (0.0, " cd</s>"),
    ]
    _, summary = tokenize_rows(read_rows(pair), tok, DataConfig(missing_eos_penalty=1))
    assert summary["dropped_tied"] == 1 and summary["rows"] == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Q", "responses": ["a", "b"], "scores": [1, 0], "cut": [1, 0]}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: field 'cut' must be a list of 2 booleans"):
        read_rows(str(bad))


ROW_ERRORS = {
    "mixed.jsonl": (
        '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"chosen": "ab", "rejected": "ac"}\n',
        ":2: this row is implicit-prompt standard, but the first row (",
        "mixed formats in one file are refused",
    ),
    "mixedfields.jsonl": (
        '{"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"}\n',
        ":1: fields mix strings and message lists",
        "",
    ),
    "badmessage.json": (
        '[\n{"prompt": [{"role": "user"}], "chosen": [], "rejected": []}]',
        " row 1: field 'prompt' message 0: expected",
        "",
    ),
    "noprefix.jsonl": (
        '{"chosen": "abc", "rejected": "xyz"}\n',
        ":1: fields 'chosen' and 'rejected' share no prefix",
        "",
    ),
    "badmargin.jsonl": (
        '{"prompt": "a", "chosen": "b", "rejected": "c", "margin": "big"}\n',
        ":1: field 'margin' must be a finite number, got 'big'",
        "",
    ),
}


@pytest.mark.parametrize("name", sorted(ROW_ERRORS))
def test_malformed_rows_name_file_line_and_field(tmp_path, name):
    text, message, more = ROW_ERRORS[name]
    (tmp_path / name).write_text(text)
    _, tok = tiny(seed=0)
    with pytest.raises(DataError) as info:
        _tokens_of(tmp_path / name, tok)
    assert str(info.value).startswith(f"{tmp_path / name}{message}") and more in str(info.value), (
        str(info.value)
    )


def test_inspector_prints_the_trained_tokens_decoded_and_a_summary(tmp_path, capsys):
    rows = [
        {
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "chosen": [{"role": "assistant", "content": "yes" * i}],
            "rejected": [{"role": "assistant", "content": "no"}],
        }
        for i in range(1, 5)
    ]
    path = _write_jsonl(tmp_path / "conv.jsonl", rows)
    data.inspect(
        [path, "--model", "tiny", "--show", "2", "--max-length", "34", "--max-prompt-length", "24"]
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 3
    # A pair file's rows as the user wrote them: chosen, then rejected.
    assert lines[0] == {
        "prompt": "<|user|>\nq1\n<|assistant|>\n",
        "chosen": "yes</s>",
        "rejected": "no</s>",
    }
    assert lines[1]["chosen"] == "yesyes</s>"
    summary = lines[2]
    # Prompts are 26 bytes. Pairs 3 and 4 exceed 34: the prompt keeps its last 24 bytes, then "yes"
    # x 3 + EOS fits in the 10 left; "yes" x 4 + EOS (13) does not, and is cut.
    assert summary["pairs"]["all"] == 4 and summary["dropped"] == 0 and summary["truncated"] == 2
    assert summary["truncated_prompts"] == 2 and summary["truncated_responses"] == 1
    assert summary["tokens_before_truncation"]["response"]["p100"] == 13
    # K scored responses: each with its score as read; the repeated response kept once.
    scored = _write_jsonl(
        tmp_path / "scored.jsonl",
        [{"prompt": "q", "responses": ["a", "b", "c", "b"], "scores": [0.1, 2, -1, 2]}],
    )
    data.inspect([scored, "--model", "tiny", "--show", "1"])
    shown, _ = capsys.readouterr().out.splitlines()
    assert json.loads(shown) == {
        "prompt": "q",
        "responses": [
            {"score": 0.1, "text": "a</s>"},
            {"score": 2.0, "text": "b</s>"},
            {"score": -1.0, "text": "c</s>"},
        ],
    }
    with pytest.raises(SystemExit) as exit_info:  # a bad file
        data.inspect([str(tmp_path / "nope.jsonl"), "--model", "tiny"])
    assert (
        exit_info.value.code == 2
        and capsys.readouterr().err.strip()
        == f"error: {tmp_path / 'nope.jsonl'}: no "
        "such file (give a .jsonl/.json path, hub:NAME[:split] or demo)"
    )


def test_hub_path_reads_a_saved_dataset_like_the_file(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    rows = demo_pairs("eval")[:5]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(
        str(tmp_path / "dd")
    )

    def strip(rows):
        return [as_pair(r) for r in rows]

    hub = read_rows(f"hub:{tmp_path / 'ds'}")
    assert strip(hub) == rows and hub[4]["where"] == f"hub:{tmp_path / 'ds'} row 5"
    assert strip(read_rows(f"hub:{tmp_path / 'dd'}:test")) == rows[:2]
    # Through prepare_data: cached under the dataset's fingerprint, a new key when the saved data
    # changes.
    _, tok = tiny(seed=0)
    first, _, _ = prepare_data(
        DataConfig(data=(f"hub:{tmp_path / 'ds'}",)), tok, str(tmp_path / "cache")
    )
    assert [as_pair(first[i]) for i in range(5)] == tokenize(rows, tok, 512, 256)
    datasets.Dataset.from_list(rows[:3]).save_to_disk(str(tmp_path / "ds2"))
    shutil.rmtree(tmp_path / "ds")
    (tmp_path / "ds2").rename(tmp_path / "ds")
    again, _, _ = prepare_data(
        DataConfig(data=(f"hub:{tmp_path / 'ds'}",)), tok, str(tmp_path / "cache")
    )
    assert len(again) == 3 and len(os.listdir(tmp_path / "cache")) == 2
    with pytest.raises(DataError, match=r"hub:.*dd:nosplit: cannot load \(KeyError"):
        read_rows(f"hub:{tmp_path / 'dd'}:nosplit")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(DataError, match=r"need the datasets package \(pip install datasets\)"):
        read_rows(f"hub:{tmp_path / 'ds'}")


def _char_tokenizer():
    """A character-level fast tokenizer over printable ASCII, with no chat template and no BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    vocab = {"<pad>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", pad_token="<pad>")


def _message(role, content):
    return {"role": role, "content": content}


# (prompt, shared messages after the prompt's user turn, chosen answer, rejected answer)
_TURNS = [
    ("Rate the mug", [], "Great. 5/5", "Bad. 1/5"),
    ("Rate the lamp", [], "Bright. 4/5", "Dim. 2/5"),
    # Multi-turn: the shared messages run on past the prompt's turn.
    (
        "Name a color",
        [_message("assistant", "Red."), _message("user", "Another?")],
        "Blue.",
        "No.",
    ),
]


def _ultrafeedback_rows():
    rows = []
    for i, (prompt, more, good, bad) in enumerate(_TURNS):
        chosen = [_message("user", prompt), *more, _message("assistant", good)]
        rows.append(
            {
                "prompt": prompt,
                "chosen": chosen,
                "rejected": [_message("user", prompt), *more, _message("assistant", bad)],
                "messages": chosen,
                "score_chosen": 8.0,
                "score_rejected": 5.0,
                "prompt_id": f"id{i}",
            }
        )
    return rows


def _conversational_rows():
    return [
        {
            "prompt": [_message("user", prompt), *more],
            "chosen": [_message("assistant", good)],
            "rejected": [_message("assistant", bad)],
        }
        for prompt, more, good, bad in _TURNS
    ]


def test_ultrafeedback_shape_reads_and_tokenizes_as_the_conversational_shape(tmp_path):
    tok = load_tokenizer("tiny")
    uf = _write_jsonl(tmp_path / "uf.jsonl", _ultrafeedback_rows())
    conv = _write_jsonl(tmp_path / "conv.jsonl", _conversational_rows())

    def fields(rows):
        return [as_pair(r) for r in rows]

    assert fields(read_rows(uf)) == fields(read_rows(conv)) == _conversational_rows()
    uf_tokens, uf_summary = _tokens_of(uf, tok)
    conv_tokens, conv_summary = _tokens_of(conv, tok)
    assert uf_tokens == conv_tokens and uf_summary == conv_summary and len(uf_tokens) == 3
    multi_turn = (
        "<|user|>\nName a color\n<|assistant|>\nRed.</s>\n<|user|>\nAnother?\n<|assistant|>\n"
    )
    assert uf_tokens[2]["prompt"] == tok(multi_turn, add_special_tokens=False)["input_ids"]
    # A system turn may come first; the prompt is still the shared first messages.
    system = _ultrafeedback_rows()[:1]
    for field in ("chosen", "rejected"):
        system[0][field] = [_message("system", "Be brief."), *system[0][field]]
    (row,) = read_rows(_write_jsonl(tmp_path / "system.jsonl", system))
    assert row["prompt"] == [_message("system", "Be brief."), _message("user", "Rate the mug")]


def test_ultrafeedback_shape_errors_name_the_row_and_the_remedy(tmp_path):
    rows = _ultrafeedback_rows()
    rows[1]["prompt"] = "Rate the desk"
    path = _write_jsonl(tmp_path / "uf.jsonl", rows)
    with pytest.raises(DataError) as error:
        read_rows(path)
    assert str(error.value) == (
        f"{path}:2: field 'prompt' is a string that no user turn among the first messages "
        "'chosen' and 'rejected' share repeats; begin both with it as a user turn, or give the "
        "prompt as a message list and the responses without it"
    )
    # Responses that leave the prompt out share no first message.
    rows = _ultrafeedback_rows()
    rows[0]["chosen"], rows[0]["rejected"] = rows[0]["chosen"][1:], rows[0]["rejected"][1:]
    with pytest.raises(DataError, match=r"uf2.jsonl:1: .* share no first message .*; begin both"):
        read_rows(_write_jsonl(tmp_path / "uf2.jsonl", rows))
    # Other mixes stay refused, with the remedy.
    mixed = [{"prompt": [_message("user", "Hi")], "chosen": "Hello", "rejected": "Go"}]
    with pytest.raises(DataError) as error:
        read_rows(_write_jsonl(tmp_path / "mixed.jsonl", mixed))
    assert str(error.value) == (
        f"{tmp_path / 'mixed.jsonl'}:1: fields mix strings and message lists (prompt: "
        "conversational, chosen: standard, rejected: standard); give all three as strings or as "
        "message lists (a string prompt goes with message-list responses that begin with it as a "
        "user turn)"
    )
    assert "\n" not in str(error.value)


def test_hub_dataset_in_ultrafeedback_shape_reads_its_named_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = _ultrafeedback_rows()
    splits = {"train_prefs": rows, "test_prefs": rows[:2]}
    datasets.DatasetDict(
        {name: datasets.Dataset.from_list(r) for name, r in splits.items()}
    ).save_to_disk(str(tmp_path / "uf"))
    test = read_rows(f"hub:{tmp_path / 'uf'}:test_prefs")
    assert [r["prompt"] for r in test] == [r["prompt"] for r in _conversational_rows()[:2]]
    rows[1]["prompt"] = "Rate the desk"
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match=rf"^hub:{tmp_path / 'bad'} row 2: field 'prompt' is a"):
        read_rows(f"hub:{tmp_path / 'bad'}")


def test_hub_config_reaches_load_dataset(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": f"p{i}", "chosen": f" c{i}", "rejected": f" r{i}"} for i in range(3)]
    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    for spec in ("org/prefs", "org/prefs:test", "org/prefs:default:train_prefs"):
        assert len(read_rows(f"hub:{spec}")) == 3
    assert calls == [
        ("org/prefs", None, "train"),
        ("org/prefs", None, "test"),
        ("org/prefs", "default", "train_prefs"),
    ]
    # A folder with a config is a dataset's files for load_dataset, not a save_to_disk folder.
    read_rows(f"hub:{tmp_path}:default:train")
    assert calls[-1] == (str(tmp_path), "default", "train")
    # The config is part of the cache key.
    tok = load_tokenizer("tiny")
    cache = str(tmp_path / "cache")
    for spec in ("hub:org/prefs:a:train", "hub:org/prefs:b:train"):
        data.tokenize_to_cache(DataConfig(data=(spec,), cache_dir=cache), tok)
    assert len(os.listdir(cache)) == 2
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"^hub:org/prefs:a:b: hub datasets need the datasets"):
        read_rows("hub:org/prefs:a:b")


_USER = [_message("user", "Rate the mug")]
_CHATML_PROMPT = "<|im_start|>user\nRate the mug<|im_end|>\n<|im_start|>assistant\n"


def _conversation(tmp_path):
    row = {
        "prompt": _USER,
        "chosen": [_message("assistant", "Great. 5/5")],
        "rejected": [_message("assistant", "Bad. 1/5")],
    }
    return _write_jsonl(tmp_path / "conv.jsonl", [row])


def _decoded(tokens, tok):
    return [{k: tok.decode(v) for k, v in pair.items()} for pair in tokens]


def _char_model(tmp_path):
    """A base model's tokenizer folder: _char_tokenizer, without a chat template."""
    folder = str(tmp_path / "char")
    _char_tokenizer().save_pretrained(folder)
    return folder


def test_chat_template_renders_message_lists_for_a_tokenizer_without_one(tmp_path):
    """--chat-template replaces the tokenizer's template as loaded (so the export saves it too)."""
    folder = _char_model(tmp_path)
    path = _conversation(tmp_path)
    with pytest.raises(DataError, match=r"conv.jsonl:1: message lists need a chat template"):
        _tokens_of(path, load_tokenizer(folder))
    chatml = {
        "prompt": _CHATML_PROMPT,
        "chosen": "Great. 5/5<|im_end|>\n</s>",
        "rejected": "Bad. 1/5<|im_end|>\n</s>",
    }
    tok = load_tokenizer(folder, "chatml")
    assert tok.chat_template == data._CHAT_TEMPLATES["chatml"]
    tokens, _ = _tokens_of(path, tok)
    assert _decoded(tokens, tok) == [chatml]
    assert tokens[0]["prompt"] == tok(_CHATML_PROMPT, add_special_tokens=False)["input_ids"]
    # A Jinja file works the same: the shipped text gives the same tokens, another its own.
    shipped = tmp_path / "chatml.jinja"
    shipped.write_text(data._CHAT_TEMPLATES["chatml"])
    assert _tokens_of(path, load_tokenizer(folder, str(shipped)))[0] == tokens
    plain = tmp_path / "plain.jinja"
    plain.write_text(
        "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    assert _decoded(_tokens_of(path, load_tokenizer(folder, str(plain)))[0], tok) == [
        {
            "prompt": "user: Rate the mug\nassistant: ",
            "chosen": "Great. 5/5\n</s>",
            "rejected": "Bad. 1/5\n</s>",
        }
    ]
    # It replaces a tokenizer's own template too.
    tiny = load_tokenizer("tiny", "chatml")
    assert _decoded(_tokens_of(path, tiny)[0], tiny) == [chatml]
    # A missing file or a name not shipped: one line naming the flag.
    for name in ("chatml2", str(tmp_path / "none.jinja")):
        with pytest.raises(ValueError) as error:
            load_tokenizer(folder, name)
        assert str(error.value) == (
            f"--chat-template {name}: no such file, and not a template this project ships (chatml)"
        )


def test_chat_template_is_part_of_the_cache_key(tmp_path):
    folder = _char_model(tmp_path)
    tok = load_tokenizer(folder)
    path = _conversation(tmp_path)
    template = tmp_path / "t.jinja"
    template.write_text(data._CHAT_TEMPLATES["chatml"])

    def cached(name):
        config = DataConfig(data=(path,), cache_dir=str(tmp_path / "cache"), chat_template=name)
        return data.tokenize_to_cache(config, load_tokenizer(folder, name))

    first = cached("chatml")
    assert cached("chatml") == first and cached(str(template)) != first
    # An edited file is a new template: its tokens are not reused.
    before = cached(str(template))
    template.write_text(data._CHAT_TEMPLATES["chatml"].replace("im_", "turn_"))
    after = cached(str(template))
    assert after != before
    train, _, _ = data.load_tokens(after)
    assert tok.decode(train[0]["prompt"]).startswith("<|turn_start|>user")


def test_inspector_takes_a_chat_template(tmp_path, capsys):
    path = _conversation(tmp_path)
    data.inspect([path, "--model", "tiny", "--chat-template", "chatml", "--show", "1"])
    shown, _ = capsys.readouterr().out.splitlines()
    assert json.loads(shown) == {
        "prompt": _CHATML_PROMPT,
        "chosen": "Great. 5/5<|im_end|>\n</s>",
        "rejected": "Bad. 1/5<|im_end|>\n</s>",
    }
    with pytest.raises(SystemExit) as exit_info:
        data.inspect([path, "--model", "tiny", "--chat-template", "nope"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: --chat-template nope: no such file, and not a template this project ships "
        "(chatml)\n"
    )


def test_eval_fraction_holds_out_a_fixed_disjoint_share(tmp_path):
    _, tok = tiny(seed=0)
    rows = [{"prompt": f"p{i}", "chosen": f" c{i}", "rejected": f" r{i}"} for i in range(40)]
    config = DataConfig(
        data=(
            _write_jsonl(tmp_path / "a.jsonl", rows[:25])
            + ","
            + _write_jsonl(tmp_path / "b.jsonl", rows[25:]),
        ),
        eval_fraction=0.25,
    )
    assert len(config.data) == 2  # comma-separated files
    train, evals, summary = prepare_data(config, tok, str(tmp_path / "cache"))

    def prompts(t):
        return {tok.decode(t[i]["prompt"]) for i in range(len(t))}

    assert len(train) == 30 and len(evals) == 10 and summary["eval"]["pairs"]["all"] == 10
    assert prompts(train) | prompts(evals) == {f"p{i}" for i in range(40)} and not prompts(
        train
    ) & prompts(evals)
    _, again, _ = prepare_data(
        DataConfig(data=config.data, eval_fraction=0.25), tok, str(tmp_path / "other")
    )
    assert prompts(again) == prompts(evals)
    with pytest.raises(ValueError, match="not both"):
        DataConfig(eval_data=("x.jsonl",), eval_fraction=0.1)


def test_several_files_of_different_formats_train_end_to_end(tmp_path):
    """Plain, conversational and ultrafeedback_binarized-shaped files in one run."""
    pairs = demo_pairs("train")[:32]
    std = _write_jsonl(tmp_path / "std.jsonl", pairs[:16])
    conv = _write_jsonl(
        tmp_path / "conv.jsonl",
        [
            {
                "prompt": [{"role": "user", "content": p["prompt"]}],
                "chosen": [{"role": "assistant", "content": p["chosen"]}],
                "rejected": [{"role": "assistant", "content": p["rejected"]}],
            }
            for p in pairs[16:24]
        ],
    )
    # ultrafeedback_binarized's shape: a string prompt, repeated as the responses' first user turn.
    ultrafeedback = _write_jsonl(
        tmp_path / "uf.jsonl",
        [
            {
                "prompt": p["prompt"],
                "chosen": [_message("user", p["prompt"]), _message("assistant", p["chosen"])],
                "rejected": [_message("user", p["prompt"]), _message("assistant", p["rejected"])],
                "score_chosen": 8.0,
            }
            for p in pairs[24:]
        ],
    )
    out = run(
        tmp_path,
        "run",
        "--data",
        std,
        "--data",
        conv,
        "--data",
        ultrafeedback,
        "--eval-fraction",
        "0.25",
        "--batch-size",
        "8",
        "--max-steps",
        "2",
    )
    data_rows = {
        r["split"]: r
        for r in map(json.loads, open(os.path.join(out, "metrics.jsonl")))
        if r["step"] == 0
    }
    assert data_rows["data/train"]["pairs"] == 24 and data_rows["data/eval"]["pairs"] == 8
    assert len(read_metrics(out)) == 2 and read_metrics(out, "eval")[-1]["loss"] > 0


BAD_INPUTS = {
    "malformed.jsonl": (
        '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": \n',
        ":2: invalid JSON",
    ),
    "missing.jsonl": (
        '{"prompt": "a", "chosen": "b", "rejected": "c"}\n\n{"prompt": "a", "chosen": "b"}\n',
        ":3: missing field 'rejected'",
    ),
    "notstr.json": (
        '[\n  {"prompt": "a", "chosen": "b", "rejected": "c"},\n'
        '  {"prompt": "a", "chosen": 7, "rejected": "c"}\n]',
        " row 2: field 'chosen' must be a string",
    ),
    "badarray.json": (
        '[{"prompt": "a", "chosen": "b", "rejected": "c"}\n {"prompt": "a"}]',
        ":2: invalid JSON",
    ),
    # An array, whatever the file's name: its rows go by index.
    "notobject.jsonl": ('["a", "b", "c"]\n', " row 1: expected an object"),
    "nolabel.jsonl": ('{"prompt": "a", "completion": "b"}\n', ":1: missing field 'label'"),
    "textlabel.jsonl": (
        '{"prompt": "a", "completion": "b", "label": "yes"}\n',
        ":1: field 'label' must be true or false, got \"yes\"",
    ),
    "nocompletion.jsonl": ('{"prompt": "a", "label": true}\n', ":1: missing field 'completion'"),
    "onelabel.jsonl": (
        '{"prompt": "a", "completion": "b", "label": true}\n'
        '{"prompt": "c", "completion": "d", "label": true}\n',
        ": every label is true; an unpaired loss needs desirable and undesirable responses",
    ),
    "object.json": (
        '{"prompt": "a", "chosen": "b", "rejected": "c"}\n',
        ":1: expected a JSON array of pair objects, got an object",
    ),
    "string.json": ('\n"pairs"\n', ":2: expected a JSON array of pair objects, got a string"),
    "number.json": ("3", ":1: expected a JSON array of pair objects, got a number"),
    "empty.jsonl": ("\n  \n", ":1: empty file"),
    "absent.jsonl": (None, ": no such file"),
    "latin1.jsonl": (
        b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "caf\xe9", "chosen": "b"}\n',
        ":2: not UTF-8 text (byte 0xe9 at column 16)",
    ),
}


def test_json_lines_under_a_json_name_still_read(tmp_path):
    # As datasets' Dataset.to_json writes them: one object per line.
    path = tmp_path / "lines.json"
    path.write_text(
        '{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
        '{"prompt": "a", "chosen": "d", "rejected": "e"}\n'
    )
    assert [r["where"] for r in read_rows(str(path))] == [f"{path}:1", f"{path}:2"]


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_is_one_clean_line_and_writes_nothing(tmp_path, capsys, name):
    text, message = BAD_INPUTS[name]
    path = tmp_path / name
    if text is not None:
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(DataError, match=re.escape(message)):
        read_rows(str(path))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        train_dpo.main(["--data", str(path), "--out-dir", str(out), *ON_CPU])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and not out.exists()
    assert err.startswith(f"error: {path}") and message in err and "\n" not in err


def test_a_bad_row_is_named_by_its_index_in_a_json_array_and_by_its_line_in_json_lines(
    tmp_path, capsys
):
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 2 + [{"prompt": "a", "chosen": "b"}]
    array, lines = tmp_path / "prefs.json", tmp_path / "prefs.jsonl"
    # Indented, so that no row's line is its index; a blank line before the bad row.
    array.write_text(json.dumps(rows, indent=2))
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + "\n" + json.dumps(rows[2]))
    for path, where in ((array, f"{array} row 3"), (lines, f"{lines}:4")):
        with pytest.raises(DataError, match=f"^{re.escape(where)}: missing field 'rejected'$"):
            read_rows(str(path))
        out = tmp_path / f"run-{path.suffix[1:]}"
        with pytest.raises(SystemExit) as exit_info:
            train_dpo.main(["--data", str(path), "--out-dir", str(out), *ON_CPU])
        assert exit_info.value.code == 2 and not out.exists()
        assert capsys.readouterr().err.strip() == f"error: {where}: missing field 'rejected'"


BYTES = data.load_tokenizer("tiny")
EOS = BYTES.eos_token_id


def ids(text):
    return BYTES(text, add_special_tokens=False)["input_ids"]


def user(text):
    return [{"role": "user", "content": text}]


def bot(text):
    return [{"role": "assistant", "content": text}]


def write(path, rows):
    """JSON Lines of `rows` (dicts, or raw text lines); returns the path as a string."""
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return str(path)


def tokens_of(path, tok=BYTES, **config):
    tokens, summary = tokenize_rows(read_rows(str(path)), tok, DataConfig(**config))
    return [tokens[i] for i in range(len(tokens))], summary, tokens


HH = "\n\nHuman: Rate the mug\n\nAssistant:"


def test_a_prompt_rendered_with_its_bos_gets_no_second_one(tmp_path):
    """RLHFlow's prompts are rendered by the chat template, BOS included."""
    path = write(
        tmp_path / "k.jsonl", [{"prompt": "<s>ab", "responses": ["c", "d"], "rewards": [1, 2]}]
    )
    assert tokens_of(path, _bos_tokenizer())[0][0]["prompt"] == [1, 3, 4]


def test_each_published_shape_reads_as_scored_responses(tmp_path):
    files = {
        "local.jsonl": [
            {"prompt": "Q1", "responses": ["a", "b", "c"], "scores": [0.5, 2, -1]},
        ],
        "local_messages.jsonl": [
            {"prompt": user("Q1"), "responses": [bot("a"), bot("b")], "scores": [0, 1]},
        ],
        "rlhflow.jsonl": [
            {"prompt": "<|user|>\nQ1\n<|assistant|>\n", "responses": ["a", "b"], "rewards": [3, 1]},
        ],
        "armorm.jsonl": [
            {
                "prompt": "Q1",
                "all_generated_responses": ["a", "b", "c"],
                "all_rm_scores": [0.1, 0.3, 0.2],
                "chosen": user("Q1") + bot("b"),
                "rejected": user("Q1") + bot("a"),
            },
        ],
        "ultrafeedback.jsonl": [
            {
                "instruction": "Q1",
                "completions": [
                    {"response": "a", "overall_score": 7.5, "model": "m1"},
                    {"response": "b", "overall_score": 9, "annotations": {}},
                ],
            },
        ],
        "nectar.jsonl": [
            {
                "prompt": HH,
                "answers": [
                    {"answer": " a", "rank": 2, "model": "m"},
                    {"answer": " b", "rank": 1},
                    {"answer": " c", "rank": 3},
                ],
            },
        ],
    }
    read = {name: read_rows(write(tmp_path / name, rows)) for name, rows in files.items()}
    strip = {
        name: [{k: r[k] for k in ("prompt", "responses", "scores")} for r in rows]
        for name, rows in read.items()
    }
    assert strip == {
        "local.jsonl": [{"prompt": "Q1", "responses": ["a", "b", "c"], "scores": [0.5, 2.0, -1.0]}],
        "local_messages.jsonl": [
            {"prompt": user("Q1"), "responses": [bot("a"), bot("b")], "scores": [0.0, 1.0]}
        ],
        "rlhflow.jsonl": [
            {
                "prompt": "<|user|>\nQ1\n<|assistant|>\n",
                "responses": ["a", "b"],
                "scores": [3.0, 1.0],
            }
        ],
        # armorm's and UltraFeedback's strings are a chat: as armorm's own chosen and rejected.
        "armorm.jsonl": [
            {
                "prompt": user("Q1"),
                "responses": [bot("a"), bot("b"), bot("c")],
                "scores": [0.1, 0.3, 0.2],
            }
        ],
        "ultrafeedback.jsonl": [
            {"prompt": user("Q1"), "responses": [bot("a"), bot("b")], "scores": [7.5, 9.0]}
        ],
        # Nectar: rank 1 is the best, so the highest score; the HH prompt as given.
        "nectar.jsonl": [
            {"prompt": HH, "responses": [" a", " b", " c"], "scores": [-2.0, -1.0, -3.0]}
        ],
    }
    assert read["ultrafeedback.jsonl"][0]["fields"] == [
        "completions[0].response",
        "completions[1].response",
    ]
    assert read["nectar.jsonl"][0]["where"] == f"{tmp_path / 'nectar.jsonl'}:1"
    chat = "<|user|>\nQ1\n<|assistant|>\n"
    rows = {name: tokens_of(tmp_path / name)[0] for name in files}
    assert rows["local.jsonl"] == [
        {
            "prompt": ids("Q1"),
            "responses": [ids("a") + [EOS], ids("b") + [EOS], ids("c") + [EOS]],
            "scores": [0.5, 2.0, -1.0],
            "margin": 0.0,
        }
    ]
    # The chat shapes render with the template, each response keeping its end-of-turn EOS once.
    for name in ("local_messages.jsonl", "armorm.jsonl", "ultrafeedback.jsonl"):
        assert rows[name][0]["prompt"] == ids(chat), name
        assert rows[name][0]["responses"][:2] == [ids("a") + [EOS], ids("b") + [EOS]], name
    assert rows["rlhflow.jsonl"][0]["prompt"] == ids(chat)
    assert rows["nectar.jsonl"][0]["prompt"] == ids(HH)
    assert rows["nectar.jsonl"][0]["responses"][1] == ids(" b") + [EOS]
    scores = pytest.approx([0.1, 0.3, 0.2])
    assert rows["armorm.jsonl"][0]["scores"] == scores  # float32


def test_hub_dataset_with_pair_columns_reads_its_k_responses(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [
        {
            "prompt": f"Q{i}",
            "all_generated_responses": ["a", "b"],
            "all_rm_scores": [0.0, float(i + 1)],
            "chosen": user(f"Q{i}") + bot("b"),
            "rejected": user(f"Q{i}") + bot("a"),
        }
        for i in range(3)
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    read = read_rows(f"hub:{tmp_path / 'ds'}")
    assert [r["scores"] for r in read] == [[0.0, 1.0], [0.0, 2.0], [0.0, 3.0]]
    assert read[2]["where"] == f"hub:{tmp_path / 'ds'} row 3" and read[0]["responses"] == [
        bot("a"),
        bot("b"),
    ]


def _mean_best(tokens):
    """Mean tokens of each row's best response (the first of equal bests), row by row."""
    rows = [tokens[i] for i in range(len(tokens))]
    return sum(len(r["responses"][r["scores"].index(max(r["scores"]))]) for r in rows) / len(rows)


def test_k_varies_per_row_from_2_to_8(tmp_path):
    rows = [
        {
            "prompt": f"P{k}",
            "responses": [f"r{j}" * (j + 1) for j in range(k)],
            "scores": list(range(k)),
        }
        for k in (2, 8, 3, 5)
    ]
    got, summary, tokens = tokens_of(write(tmp_path / "k.jsonl", rows))
    assert tokens.lengths.shape == (4, 9) and tokens.scores.shape == (4, 8)
    assert tokens.lengths.dtype == torch.int64 and tokens.scores.dtype == torch.float32
    assert tokens.ids.dtype == torch.int32
    assert tokens.lengths[0].tolist() == [2, 3, 5, 0, 0, 0, 0, 0, 0]
    assert tokens.scores[0, :2].tolist() == [0, 1] and tokens.scores[0, 2:].isnan().all()
    assert not tokens.scores[1].isnan().any()
    for row, got_row in zip(rows, got):
        assert got_row == {
            "prompt": ids(row["prompt"]),
            "responses": [ids(r) + [EOS] for r in row["responses"]],
            "scores": [float(s) for s in row["scores"]],
            "margin": 0.0,
        }
    # Distinct scores: all pairs is K (K - 1) / 2 a row, best-vs-rest K - 1, best-vs-worst 1.
    assert summary["rows"] == 4 and summary["responses"] == 18
    assert summary["pairs"] == {
        "all": 1 + 28 + 3 + 10,
        "best-vs-rest": 1 + 7 + 2 + 4,
        "best-vs-worst": 4,
    }
    # The best (the highest score) is each row's last and longest response: 2k + 1 tokens.
    assert _mean_best(tokens) == sum(2 * k + 1 for k in (2, 8, 3, 5)) / 4


def test_rows_that_rank_nothing_and_repeated_responses_are_dropped_and_counted(tmp_path):
    lines = [
        '{"prompt": "p", "responses": ["a", "b", "c"], "scores": [1, NaN, 0]}\n',  # unscored
        '{"prompt": "p", "responses": ["a", "b"], "scores": [1, Infinity]}\n',  # unscored
        '{"prompt": "p", "responses": ["a", "b"], "scores": [1, null]}\n',  # unscored
        '{"prompt": "p", "responses": ["a", "b"], "scores": [1, "2"]}\n',  # unscored
        '{"prompt": "p", "responses": ["a", "b"], "scores": [true, 0]}\n',  # unscored
        '{"prompt": "p", "responses": ["a", "b", "c"], "scores": [2, 2, 2]}\n',  # tied
        '{"prompt": "p", "responses": ["a"], "scores": [2]}\n',  # tied: one response
        '{"prompt": "p", "responses": [], "scores": []}\n',  # tied: none
        '{"prompt": "p", "responses": ["", "b"], "scores": [1, 0]}\n',  # one left: dropped_empty
        '{"prompt": "p", "responses": ["a", "a", "b"], "scores": [1, 2, 1]}\n',  # dropped_identical
        '{"prompt": "p", "responses": ["", "a", "b", "a"], "scores": [5, 2, 1, 3]}\n',  # kept: a, b
        '{"prompt": "p", "responses": ["x", "y", "z"], "scores": [1, 1, 0]}\n',  # kept: equal bests
    ]
    got, summary, tokens = tokens_of(write(tmp_path / "d.jsonl", lines))
    assert [r["responses"] for r in got] == [
        [ids("a") + [EOS], ids("b") + [EOS]],
        [ids("x") + [EOS], ids("y") + [EOS], ids("z") + [EOS]],
    ]
    assert [r["scores"] for r in got] == [[2.0, 1.0], [1.0, 1.0, 0.0]]
    assert {k: v for k, v in summary.items() if k != "tokens_before_truncation"} == {
        # (2, 1) gives one pair; (1, 1, 0) two, of which one is the first best's.
        "pairs": {"all": 3, "best-vs-rest": 2, "best-vs-worst": 2},
        "rows": 2,
        "unpaired": False,
        "responses": 5,
        "dropped": 10,
        "dropped_unscored": 5,
        "dropped_tied": 3,
        "dropped_empty": 1,
        "dropped_identical": 1,
        "identical_after_truncation": 0,
        "empty_responses": 2,
        "identical_responses": 2,
        "truncated": 0,
        "truncated_prompts": 0,
        "truncated_responses": 0,
        "retokenized": 0,
        "cut_responses": 0,
    }
    assert tokens.lengths.shape == (2, 4)
    # The first of equal bests: "x".
    assert _mean_best(tokens) == 2.0


def test_truncation_keeps_the_prompt_rule_and_cuts_each_response_to_the_room(tmp_path):
    rows = [
        # 4 + the longest (4) <= 12: nothing cut.
        {"prompt": "abcd", "responses": ["xyz", "q", "rs"], "scores": [1, 2, 3]},
        # 10 + 9 > 12: the prompt keeps its last 5; each response is cut to the 7 left.
        {
            "prompt": "0123456789",
            "responses": ["abcdefgh", "q", "abcdefgX", "abcdefghij"],
            "scores": [1, 2, 3, 4],
        },
        # All the same once cut: dropped, identical after truncation.
        {"prompt": "0123456789", "responses": ["abcdefgh", "abcdefgX"], "scores": [1, 2]},
    ]
    path = write(tmp_path / "t.jsonl", rows)
    got, summary, _ = tokens_of(path, max_length=12, max_prompt_length=5)
    start, _, _ = tokens_of(path, max_length=12, max_prompt_length=5, truncation="keep_start")
    assert got[0] == {
        "prompt": ids("abcd"),
        "responses": [ids("xyz") + [EOS], ids("q") + [EOS], ids("rs") + [EOS]],
        "scores": [1.0, 2.0, 3.0],
        "margin": 0.0,
    }
    # Cut responses keep no EOS; "abcdefgX" and "abcdefghij" repeat "abcdefgh" once cut: the first
    # stays.
    assert got[1] == {
        "prompt": ids("56789"),
        "responses": [ids("abcdefg"), ids("q") + [EOS]],
        "scores": [1.0, 2.0],
        "margin": 0.0,
    }
    assert start[1]["prompt"] == ids("01234") and len(got) == len(start) == 2
    assert (
        summary["truncated"],
        summary["truncated_prompts"],
        summary["truncated_responses"],
        summary["identical_responses"],
        summary["dropped_identical"],
        summary["identical_after_truncation"],
    ) == (2, 2, 2, 3, 1, 1)  # the dropped row was truncated too
    # Lengths before truncation: the longest response of each row.
    assert summary["tokens_before_truncation"]["response"]["p100"] == 11


K_ERRORS = {
    "notlist.jsonl": (
        {"prompt": "p", "responses": "a", "scores": [1]},
        ":1: field 'responses' must be a list of responses, got str",
    ),
    "length.jsonl": (
        {"prompt": "p", "responses": ["a", "b", "c"], "rewards": [1, 2]},
        ":1: field 'rewards' must be a list of 3 scores, one for each response in field "
        "'responses'; got 2",
    ),
    "noscores.jsonl": (
        {"prompt": "p", "all_generated_responses": ["a", "b"]},
        ":1: field 'all_rm_scores' must be a list of 2 scores, one for each response in field "
        "'all_generated_responses'; got null",
    ),
    "scorestring.jsonl": (
        {"prompt": "p", "responses": ["a", "b"], "scores": "12"},
        ":1: field 'scores' must be a list of 2 scores, one for each response in field "
        "'responses'; got a string",
    ),
    "item.jsonl": (
        {"instruction": "p", "completions": [{"response": "a", "overall_score": 1}, "b"]},
        ":1: field 'completions' item 1: expected an object with 'response' and 'overall_score', "
        'got "b"',
    ),
    "noresponse.jsonl": (
        {"prompt": "p", "answers": [{"answer": "a", "rank": 1}, {"rank": 2}]},
        ":1: missing field 'answers[1].answer'",
    ),
    "noprompt.jsonl": (
        {"instruction": None, "completions": []},
        ":1: missing field 'instruction'",
    ),
    "notstr.jsonl": (
        {"prompt": "p", "responses": ["a", 7], "scores": [1, 2]},
        ":1: field 'responses[1]' must be a string or a list of messages, got int",
    ),
    "badmessage.jsonl": (
        {"prompt": user("p"), "responses": [bot("a"), [{"role": "assistant"}]], "scores": [1, 2]},
        ":1: field 'responses[1]' message 0: expected",
    ),
    "mixedfields.jsonl": (
        {"prompt": "p", "responses": [bot("a"), bot("b")], "scores": [1, 2]},
        ":1: fields mix strings and message lists (prompt: standard, responses[0]: conversational, "
        "responses[1]: conversational); give the prompt and every response as strings or as "
        "message lists",
    ),
}


@pytest.mark.parametrize("name", sorted(K_ERRORS))
def test_malformed_k_rows_name_file_line_and_field(tmp_path, name):
    row, message = K_ERRORS[name]
    path = write(tmp_path / name, [row])
    with pytest.raises(DataError) as info:
        read_rows(path)
    assert str(info.value) == f"{path}{message}" or (
        message.endswith("expected") and str(info.value).startswith(f"{path}{message}")
    ), str(info.value)
    assert "\n" not in str(info.value)


def test_mixed_shapes_in_one_file_are_refused(tmp_path):
    k = {"prompt": "p", "responses": ["a", "b"], "scores": [1, 2]}
    pair, rlhflow = (
        {"prompt": "p", "chosen": "a", "rejected": "b"},
        {"prompt": "p", "responses": ["a"], "rewards": [1]},
    )
    for second in (pair, rlhflow):
        path = write(tmp_path / "m.jsonl", [k, second])
        with pytest.raises(
            DataError,
            match=r"m.jsonl:2: this row is standard.*mixed formats in one file are refused",
        ):
            read_rows(path)
    path = write(tmp_path / "p.jsonl", [pair, k])
    with pytest.raises(DataError) as info:
        read_rows(path)
    assert str(info.value) == (
        f"{path}:2: this row is standard with 'responses' and 'scores', but the first row "
        f"({path}:1) is standard; mixed formats in one file are refused"
    )


def test_cache_round_trip_keeps_rows_and_scores(tmp_path):
    rows = [
        {
            "prompt": f"P{i}",
            "responses": [f"r{j}" * (i % 4 + 1) for j in range(2 + i % 7)],
            "scores": [j * 0.5 for j in range(2 + i % 7)],
        }
        for i in range(40)
    ]
    path = write(tmp_path / "k.jsonl", rows)
    config = DataConfig(
        data=(path,),
        eval_fraction=0.25,
        cache_dir=str(tmp_path / "cache"),
        max_length=20,
        max_prompt_length=4,
    )
    cached = data.tokenize_to_cache(config, BYTES)
    train, evals, summary = load_tokens(cached)
    assert isinstance(train, RowTokens) and len(train) == 30 and len(evals) == 10
    assert summary["train"]["rows"] == 30 and summary["eval"]["responses"] == int(
        (~evals.scores.isnan()).sum()
    )
    read = read_rows(path)
    fresh = {
        tuple(t["prompt"]): t
        for tokens in [tokenize_rows(read, BYTES, config)[0]]
        for t in (tokens[i] for i in range(len(tokens)))
    }
    for split in (train, evals):
        for i in range(len(split)):
            assert split[i] == fresh[tuple(split[i]["prompt"])]
    assert {tuple(train[i]["prompt"]) for i in range(30)} | {
        tuple(evals[i]["prompt"]) for i in range(10)
    } == set(fresh)
    again = load_tokens(data.tokenize_to_cache(config, BYTES))
    torch.testing.assert_close(again[0].scores, train.scores, equal_nan=True)
    assert torch.equal(again[0].lengths, train.lengths)


def test_row_tokens_give_each_rows_prompt_and_responses_by_hand():
    lengths = torch.tensor([[2, 3, 5, 0], [1, 4, 6, 2], [3, 7, 1, 1]])
    scores = torch.tensor([[0.0, 1.0, math.nan], [2.0, 2.0, 1.0], [-1.0, -3.0, -0.5]])
    margins = torch.tensor([0.5, 0.0, -1.0])
    tokens = RowTokens(
        torch.arange(int(lengths.sum()), dtype=torch.int32), lengths, scores, margins
    )
    assert tokens[0] == {
        "prompt": [0, 1],
        "responses": [[2, 3, 4], [5, 6, 7, 8, 9]],
        "scores": [0.0, 1.0],
        "margin": 0.5,
    }
    assert tokens[2]["responses"] == [list(range(26, 33)), [33], [34]]  # after 10 + 13 + 3


def test_inspector_prints_k_rows_with_their_scores(tmp_path, capsys):
    rows = [
        {
            "instruction": "Q1",
            "completions": [
                {"response": "a", "overall_score": 0.1},
                {"response": "bb", "overall_score": 3},
                {"response": "c", "overall_score": 2},
            ],
        },
        {
            "instruction": "Q2",
            "completions": [
                {"response": "x", "overall_score": 1},
                {"response": "y", "overall_score": None},
            ],
        },
        {
            "instruction": "Q3",
            "completions": [
                {"response": "x", "overall_score": 1},
                {"response": "y", "overall_score": 2},
            ],
        },
    ]
    data.inspect([write(tmp_path / "uf.jsonl", rows), "--model", "tiny", "--show", "5"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[:2] == [
        {
            "prompt": "<|user|>\nQ1\n<|assistant|>\n",
            "responses": [
                {"score": 0.1, "text": "a</s>"},
                {"score": 3.0, "text": "bb</s>"},
                {"score": 2.0, "text": "c</s>"},
            ],
        },
        {
            "prompt": "<|user|>\nQ3\n<|assistant|>\n",
            "responses": [{"score": 1.0, "text": "x</s>"}, {"score": 2.0, "text": "y</s>"}],
        },
    ]
    assert len(lines) == 3 and lines[2]["rows"] == 2 and lines[2]["dropped_unscored"] == 1


def test_unpaired_rows_share_a_row_per_prompt_and_keep_their_labels(kto_file):
    rows = read_rows(kto_file)
    assert len(rows) == 20 and all(row.get("unpaired") for row in rows)
    # The repeated prompt joins its first row, after that row's own two reviews.
    first = KTO_ROWS[0]
    assert rows[0]["responses"] == [
        first["completion"],
        KTO_ROWS[1]["completion"],
        KTO_ROWS[-1]["completion"],
    ]
    assert rows[0]["scores"] == [1.0, 0.0, 0.0] and rows[1]["scores"] == [0.0]
    # Labels: the scores of an unpaired row; above the mean of a scored one.
    assert batches.labels([1.0, 0.0, 0.0]) == [True, False, False]
    assert batches.labels([1.0]) == [True] and batches.labels([0.0, 0.0]) == [False, False]
    assert batches.labels([3.0, 1.0, 2.5, 0.5]) == [True, False, True, False]


def test_inspector_prints_unpaired_rows_as_they_were_written(kto_file, capsys):
    data.inspect([kto_file, "--model", "tiny", "--show", "2"])
    *lines, summary = capsys.readouterr().out.strip().split("\n")
    # The first two rows: the first prompt's three lines (the one from the file's end joined them),
    # then the second prompt's one, with EOS as the tokenizer decodes it.
    assert [json.loads(line) for line in lines] == [
        {"prompt": r["prompt"], "completion": r["completion"] + "</s>", "label": r["label"]}
        for r in [KTO_ROWS[0], KTO_ROWS[1], KTO_ROWS[-1], KTO_ROWS[2]]
    ]
    assert json.loads(summary)["unpaired"] is True


def test_inspector_reports_how_rows_pack_as_the_trainer_packs_them(k_files, capsys):
    """--micro-batch-tokens: the micro-batches, rows per micro-batch and fill that the trainer's
    packing (batches.micro_batch_groups, one rank, the file's order) gives the same rows."""
    data.inspect([k_files[0], "--model", "tiny", "--show", "0", "--micro-batch-tokens", "700"])
    packing = json.loads(capsys.readouterr().out.strip().split("\n")[-1])["packing"]
    config = DataConfig(data=(k_files[0],), cache_dir=CACHE)
    rows, _, _ = data.load_tokens(data.tokenize_to_cache(config, load_tokenizer("tiny")))
    batching = BatchConfig(len(rows), packing=True, micro_batch_tokens=700).resolve(1)
    packs = micro_batch_groups(rows, list(range(len(rows))), 0, 1, batching)
    assert 1 < len(packs) < len(rows)
    tokens = int(rows.lengths.sum())  # shared rows: each prompt once, with all its responses
    assert packing == {
        "micro_batch_tokens": 700,
        "micro_batches": len(packs),
        "rows_per_micro_batch": round(len(rows) / len(packs), 2),
        "fill": round(tokens / (len(packs) * 700), 3),
    }


def test_mismatched_completions_are_the_ones_before_in_the_file_as_trl_pairs_them():
    """data.with_mismatched by hand: each response's mismatched completion is the response before
    it in the split's order, the first row's first taking the last row's last (TRL's rotation of a
    batch's completions by one, here over one batch of every row)."""
    rows = data.RowTokens(
        torch.tensor([7, 8, 1, 9, 9, 6, 5, 3, 4, 4, 4], dtype=torch.int32),
        torch.tensor([[2, 1, 2], [1, 1, 0], [1, 3, 0]]),
        torch.tensor([[1.0, 0.0], [1.0, math.nan], [0.0, math.nan]]),
    )
    paired = data.with_mismatched(rows, 512)
    assert paired[0] == {
        "prompt": [7, 8],
        "responses": [[1], [9, 9], [4, 4, 4], [1]],
        "scores": [1.0, 0.0],
        "margin": 0.0,
    }
    assert paired[1]["responses"] == [[5], [9, 9]] and paired[2]["responses"] == [[4, 4, 4], [5]]
    # Cut to fit --max-length 3 after the prompt, keeping the start, as TRL cuts its KL rows.
    cut = data.with_mismatched(rows, 3)
    assert cut[0]["responses"] == [[1], [9, 9], [4], [1]] and cut[1]["responses"] == [[5], [9, 9]]
    rb = batches.collate_rows([paired[i] for i in range(3)], 0, share_prompt=True)
    # The 4 scored responses first (column after column), then the 4 mismatched ones.
    assert rb.mismatched == 4 and rb.desirable.tolist() == [True, True, False, False]
    assert rb.response_lengths.tolist() == [1, 1, 3, 2, 3, 2, 1, 1]


# --------------------------------------------------------------------------------------- batches.py
# Batches across ranks, length grouping, the rows' layouts and the pairs of K responses.


def test_batch_layout_right_pads_rows_and_indexes_exactly_the_response_tokens():
    _, tok = tiny(seed=0)
    pairs = tokenize(
        [
            {"prompt": "Rate it:", "chosen": " fine", "rejected": " no"},
            {"prompt": "Q", "chosen": " a much longer answer", "rejected": " b"},
        ],
        tok,
        64,
        32,
    )
    batch = collate_pairs(pairs, pad_id=tok.pad_token_id)
    rows = [(p, p["chosen"]) for p in pairs] + [(p, p["rejected"]) for p in pairs]
    width = max(len(p["prompt"]) + len(r) for p, r in rows)
    assert batch.input_ids.shape == (4, width) == (4, 1 + 21 + 1)  # the longest row, not max_length
    flat_ids = batch.input_ids.flatten()
    for i, (p, resp) in enumerate(rows):
        end = len(p["prompt"]) + len(resp)
        assert (
            batch.input_ids[i, :end].tolist() == p["prompt"] + resp and resp[-1] == tok.eos_token_id
        )
        assert batch.attention_mask[i].tolist() == [1] * end + [0] * (
            width - end
        )  # padding only after
        # The scored positions of row i: each is the one before its target token, in this row.
        start = batch.response_lengths[:i].sum()
        mine = slice(start, start + len(resp))  # row after row
        assert batch.score_targets[mine].tolist() == resp
        assert (flat_ids[batch.score_index[mine] + 1] == batch.score_targets[mine]).all()
        assert (batch.score_index[mine] // width == i).all()
    # Chosen rows' tokens come first; pair i is (chosen i, rejected i).
    assert batch.response_lengths[:2].sum() == sum(len(p["chosen"]) for p in pairs)
    assert batch.chosen_index.tolist() == [0, 1] and batch.rejected_index.tolist() == [2, 3]
    # sequence_logps on the labels scores the same tokens: perturbing every other position changes
    # nothing.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, width, len(tok), generator=g)
    base = sequence_logps(logits, hf_labels(batch, pairs))
    scored = torch.zeros(4 * width, dtype=torch.bool)
    scored[batch.score_index] = True
    noisy = torch.where(
        scored.view(4, width, 1), logits, torch.randn(logits.shape, generator=g) * 50
    )
    torch.testing.assert_close(sequence_logps(noisy, hf_labels(batch, pairs)), base, rtol=0, atol=0)


@pytest.mark.parametrize("grouped", [False, True])
def test_build_batches_disjoint_across_ranks_and_deterministic(grouped):
    lengths = None
    if grouped:
        lengths = [
            (random.Random(i).randint(5, 300), random.Random(-i).randint(5, 300))
            for i in range(1000)
        ]
    one = build_batches(1000, 8, seed=5, epoch=0, lengths=lengths)
    assert len(one) == 125 and all(len(b) == 8 for b in one)
    for batch in one:
        halves = [rank_share(batch, r, 2) for r in range(2)]
        assert halves[0] + halves[1] == batch and not set(halves[0]) & set(halves[1])
    assert len({i for b in one for i in b}) == 1000
    again = build_batches(1000, 8, seed=5, epoch=0, lengths=lengths)
    assert one == again != build_batches(1000, 8, seed=5, epoch=1, lengths=lengths)
    assert (
        len(build_batches(100, 8, seed=5, epoch=0, lengths=lengths)) == 12
    )  # a partial batch is dropped
    with pytest.raises(ValueError, match="not divisible by 3 ranks"):
        rank_share(one[0], 0, 3)


@pytest.mark.parametrize("n, micro, world", [(10, 3, 2), (5, 2, 4), (7, 4, 1), (256, 8, 3)])
def test_eval_batches_cover_every_pair_once_in_equal_numbers_of_batches(n, micro, world):
    lengths = [random.Random(i).randint(1, 500) for i in range(n)]
    for by_length in (None, lengths):
        batches = [build_eval_batches(n, micro, rank, world, by_length) for rank in range(world)]
        assert len({len(b) for b in batches}) == 1 and all(
            len(i) <= micro for b in batches for i in b
        )
        assert sorted(i for b in batches for idx in b for i in idx) == list(range(n))
    # Sorted: each rank's batches run from short to long pairs.
    assert all(
        [lengths[i] for idx in b for i in idx] == sorted(lengths[i] for idx in b for i in idx)
        for b in batches
    )


def test_length_grouping_gives_at_least_90_percent_real_tokens_on_mixed_lengths():
    # Prompts of 10-400 tokens, responses of 20-400, a pair's two responses within 25% of each
    # other.
    rng, pairs = random.Random(0), []
    for _ in range(1024):
        prompt, chosen = rng.randint(10, 400), rng.randint(20, 400)
        rejected = int(chosen * rng.uniform(0.8, 1.25))
        pairs.append({"prompt": [5] * prompt, "chosen": [6] * chosen, "rejected": [7] * rejected})

    # In the default layout, prompts shared, whose row length is the grouping key in either layout.
    def efficiency(lengths):
        real = total = 0
        for batch in build_batches(len(pairs), 16, seed=0, epoch=0, lengths=lengths):
            mask = collate_pairs([pairs[i] for i in batch], 0, share_prompt=True).attention_mask
            real, total = real + mask.sum().item(), total + mask.numel()
        return real / total

    grouped, shuffled = efficiency(row_lengths(as_tokens(pairs).lengths)), efficiency(None)
    assert grouped >= 0.9 and shuffled < 0.6, (grouped, shuffled)


def test_a_shared_row_lays_out_prompt_chosen_rejected_with_restarting_positions():
    """Hand-laid: 2 pairs as 2 rows; the rejected positions restart where the prompt ends; the
    first rejected token is scored from the prompt's last position; log-prob order [chosen;
    rejected] as in separate rows; the prompt counts once."""
    pairs = [
        {"prompt": [5, 6, 7], "chosen": [8, 9], "rejected": [10, 11, 12]},
        {"prompt": [1], "chosen": [2], "rejected": [3, 4]},
    ]
    shared = collate_pairs(pairs, pad_id=0, share_prompt=True)
    separate = collate_pairs(pairs, pad_id=0)
    assert shared.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 0, 0, 0, 0]]
    assert shared.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5], [0, 1, 1, 2, 0, 0, 0, 0]]
    assert shared.segment_ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 2, 2, -1, -1, -1, -1]]
    # chosen of pair 0 (from positions 2, 3), of pair 1 (8); rejected of pair 0 (2, 5, 6), pair 1
    # (8, 10); row 1 starts at flat position 8.
    assert shared.score_index.tolist() == [2, 3, 8, 2, 5, 6, 8, 10]
    assert shared.score_targets.tolist() == [8, 9, 2, 10, 11, 12, 3, 4]
    assert shared.score_targets.tolist() == separate.score_targets.tolist()
    assert torch.equal(shared.response_lengths, separate.response_lengths)
    assert shared.response_lengths[:2].sum() == separate.response_lengths[:2].sum() == 3
    for index in ("chosen_index", "rejected_index"):
        assert torch.equal(getattr(shared, index), getattr(separate, index))
    assert shared.attention_mask.sum() == 12 and separate.attention_mask.sum() == 16
    assert separate.position_ids is None and separate.input_ids.shape == (4, 6)
    lens = torch.tensor([[3, 2, 3], [1, 1, 2]])
    # Batches group by the shared row's length in either layout: --share-prompt changes no batch.
    assert row_lengths(lens) == [8, 4]
    # FLOPs and token slots of the layout the model runs: 2 rows of 8, prompt once.
    counts = metrics.batch_counts((1.0, 0.0, 0.0), 1, False, shared)
    assert counts.tolist() == [12, 16, 16]


def test_rows_give_all_best_vs_rest_or_best_vs_worst_pairs_and_ties_never_pair():
    scores = [3.0, 1.0, 3.0, 0.0, math.nan]
    assert row_pairs(scores, "all") == [(0, 1), (0, 3), (2, 1), (1, 3), (2, 3)]
    # Of tied bests the first is the best; the other best is no lower, so no pair.
    assert row_pairs(scores, "best-vs-rest") == [(0, 1), (0, 3)]
    assert row_pairs(scores, "best-vs-worst") == [(0, 3)]
    assert row_pairs([1.0, 0.0], "all") == row_pairs([1.0, 0.0], "best-vs-worst") == [(0, 1)]
    assert row_pairs([2.0, 2.0, 2.0], "all") == []


def test_a_k_row_lays_out_each_response_once_after_its_prompt():
    """Hand-laid: a row of 3 responses and a row of 2 (one padded), shared and separate; responses
    come column after column; pairs index them."""
    rows = [
        {"prompt": [5, 6], "responses": [[7], [8, 9], [10]], "scores": [0.0, 2.0, 1.0]},
        {"prompt": [1], "responses": [[2, 3], [4]], "scores": [1.0, 0.0]},
    ]
    shared = collate_rows(rows, pad_id=0, share_prompt=True)
    assert shared.input_ids.tolist() == [[5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 0, 0]]
    assert shared.position_ids.tolist() == [[0, 1, 2, 2, 3, 2], [0, 1, 2, 1, 0, 0]]
    assert shared.segment_ids.tolist() == [[0, 0, 1, 2, 2, 3], [0, 1, 1, 2, -1, -1]]
    # Responses: row 0's first, row 1's first, row 0's second, row 1's second, row 0's third.
    assert shared.response_rows.tolist() == [0, 1, 0, 1, 0]
    assert shared.response_columns.tolist() == [0, 0, 1, 1, 2]
    assert shared.response_lengths.tolist() == [1, 2, 2, 1, 1]
    # Each response's first token from its prompt's last position (row 1 starts at 6).
    assert shared.score_index.tolist() == [1, 6, 7, 1, 3, 6, 1]
    assert shared.score_targets.tolist() == [7, 2, 3, 8, 9, 4, 10]
    # Row 0: (1 > 0), (2 > 0), (1 > 2) as responses 2 > 0, 4 > 0, 2 > 4; row 1: 1 > 3.
    assert shared.chosen_index.tolist() == [2, 4, 2, 1]
    assert shared.rejected_index.tolist() == [0, 0, 4, 3]
    assert shared.pair_tokens == (2 + 1) + (1 + 1) + (2 + 1) + (2 + 1)
    separate = collate_rows(rows, pad_id=0)
    assert separate.position_ids is None and separate.input_ids.shape == (5, 4)
    for name in ("response_lengths", "score_targets", "chosen_index", "rejected_index"):
        assert torch.equal(getattr(shared, name), getattr(separate, name)), name
    # SFT: each row's best response alone.
    best = collate_rows(rows, pad_id=0, best_only=True)
    assert best.score_targets.tolist() == [8, 9, 2, 3]
    assert best.chosen_index.tolist() == best.rejected_index.tolist() == [0, 1]


def test_packed_micro_batches_hold_whole_rows_within_their_tokens_alike_on_every_rank():
    """--packing on 1 to 3 ranks, shared and separate rows: every row of the step once, in
    micro-batches of at most --micro-batch-tokens as laid out (a longer row alone), in the step's
    order, as many on every rank; each collated as one row of exactly its tokens, scoring the same
    tokens, predicted by the same tokens at the same positions, as the padded layout."""
    rng = random.Random(0)

    class Rows(list):  # data.RowTokens' rows and lengths
        pass

    rows = Rows(
        {
            "prompt": [rng.randint(2, 99) for _ in range(rng.randint(1, 40))],
            "responses": [
                [rng.randint(2, 99) for _ in range(rng.randint(1, 30))]
                for _ in range(rng.randint(2, 4))
            ],
        }
        for _ in range(12)
    )
    for row in rows:
        row["scores"] = [float(rng.randint(0, 3)) for _ in row["responses"]]
    rows.lengths = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor([len(r["prompt"]), *map(len, r["responses"])]) for r in rows], True
    )
    batch = rng.sample(range(12), 12)
    for share, world in itertools.product((True, False), (1, 2, 3)):
        config = BatchConfig(12, share_prompt=share, packing=True, micro_batch_tokens=120)
        config = config.resolve(world)
        groups = [micro_batch_groups(rows, batch, r, world, config) for r in range(world)]
        assert len({len(mine) for mine in groups}) == 1
        assert sorted(i for mine in groups for pack in mine for i in pack) == list(range(12))
        for pack in (pack for mine in groups for pack in mine):
            assert pack == sorted(pack, key=batch.index)
            # Laid out: each prompt once (shared) or once per response, and every response.
            tokens = sum(
                len(rows[i]["prompt"]) * (1 if share else len(rows[i]["responses"]))
                + sum(map(len, rows[i]["responses"]))
                for i in pack
            )
            assert tokens <= 120 or len(pack) == 1
            packed = collate_rows([rows[i] for i in pack], 0, share, packing=True)
            padded = collate_rows([rows[i] for i in pack], 0, share)
            assert packed.input_ids.shape == (1, tokens) and packed.attention_mask.all()
            for key in ("score_targets", "response_lengths", "chosen_index", "rejected_index"):
                assert torch.equal(getattr(packed, key), getattr(padded, key)), key
            at = padded.score_index
            positions = at % padded.input_ids.shape[1]
            if share:
                positions = padded.position_ids.flatten()[at]
            assert torch.equal(
                packed.input_ids.flatten()[packed.score_index], padded.input_ids.flatten()[at]
            )
            assert torch.equal(packed.position_ids.flatten()[packed.score_index], positions)


def test_both_layouts_form_the_same_batches():
    lengths = torch.tensor([[3, 5, 2, 0], [9, 1, 1, 1], [2, 8, 8, 0], [4, 4, 4, 4]])
    configs = [batches.BatchConfig(batch_size=2, share_prompt=s) for s in (True, False)]
    steps = [batches.StepBatches(lengths, c, seed=3) for c in configs]
    assert steps[0](0) == steps[1](0) and steps[0](1) == steps[1](1)


# ------------------------------------------------------------------------------------------ loss.py
# The objectives by hand: pairwise, length-normalised, mixed, listwise and unpaired losses.


def _logsig(x):  # log sigmoid, without overflow at large |x|
    return min(x, 0.0) - math.log1p(math.exp(-abs(x)))


def _sig(x):
    return math.exp(_logsig(x))


LOSSES = [
    "dpo",
    "cdpo",
    "ipo",
    "hinge",
    "robust",
    "simpo",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "aot",
    "aot_pair",
    "dpo_norm",
    "sft",
]


@pytest.mark.parametrize("loss_type", LOSSES)
def test_preference_loss_matches_hand_computed_values(loss_type):
    # The last two pairs have margins of +-1000 (beta h = +-250): exp(250) is inf in float32, so a
    # loss that forms it (DiscoPOP's exp(-z)) must be computed stably, with finite values and
    # gradients.
    pc, pr = [-1.0, -4.0, -2.5, -1.0, -1000.0], [-2.0, -1.0, -3.0, -1000.0, -1.0]
    rc, rr = [-1.5, -3.0, -2.0, -500.0, -500.0], [-1.5, -2.0, -2.0, -500.0, -500.0]
    beta, eps, gamma, tau = 0.25, (0.2 if loss_type in ("cdpo", "robust") else 0.0), 0.3, 0.05
    sig, n = _sig, len(pc)

    def dpo(z):
        return -_logsig(z)

    # bco_pair's shift: the batch mean of all rewards; aot and aot_pair pair up sorted values across
    # the batch.
    d = beta * sum((a - c) + (b - e) for a, b, c, e in zip(pc, pr, rc, rr)) / (2 * n)
    policy_margins, ref_margins = (
        sorted(a - b for a, b in zip(pc, pr)),
        sorted(c - e for c, e in zip(rc, rr)),
    )
    chosen_ratios, rejected_ratios = (
        sorted(a - c for a, c in zip(pc, rc)),
        sorted(b - e for b, e in zip(pr, rr)),
    )
    aot = [beta * (x - y) for x, y in zip(policy_margins, ref_margins)]
    aot_pair = [beta * (x - y) for x, y in zip(chosen_ratios, rejected_ratios)]
    expected = []
    for i, (a, b, c, e) in enumerate(zip(pc, pr, rc, rr)):
        cw, rw = a - c, b - e
        h = cw - rw
        z = beta * h
        expected.append(
            {
                "exo_pair": sig(z) * (_logsig(z) - math.log(1 - 1e-3))
                + sig(-z) * (_logsig(-z) - math.log(1e-3)),
                "nca_pair": -_logsig(beta * cw)
                - 0.5 * _logsig(-beta * cw)
                - 0.5 * _logsig(-beta * rw),
                "bco_pair": -_logsig(beta * cw - d) - _logsig(-(beta * rw - d)),
                "sppo_hard": (cw - 0.5 / beta) ** 2 + (rw + 0.5 / beta) ** 2,
                "apo_zero": (1 - sig(beta * cw)) + sig(beta * rw),
                "apo_down": sig(beta * cw) + (1 - sig(z)),
                "discopop": (1 - sig(z / tau)) * dpo(z) + math.exp(_logsig(z / tau) - z),
                "aot": dpo(aot[i]),
                "aot_pair": dpo(aot_pair[i]),
                "dpo_norm": dpo(
                    z
                ),  # the formula of dpo; the mean log-probs are the caller's (LossConfig.averages)
                "sft": 0.0,  # all of it is chosen_nll, added by the caller
                "dpo": dpo(z),
                "cdpo": -(1 - eps) * _logsig(beta * h) - eps * _logsig(-beta * h),
                "ipo": (h - 1 / (2 * beta)) ** 2,
                "hinge": max(0.0, 1 - beta * h),
                "robust": (-(1 - eps) * _logsig(beta * h) + eps * _logsig(-beta * h))
                / (1 - 2 * eps),
                "simpo": -_logsig(beta * (a - b) - gamma),
            }[loss_type]
        )

    def t(xs):
        return torch.tensor(xs, dtype=torch.float64, requires_grad=True)

    free = loss_type in ("simpo", "sft")
    inputs = [t(pc), t(pr)] + ([] if free else [t(rc), t(rr)])
    refs = (None, None) if free else inputs[2:]
    losses, cr, rj = preference_loss(
        *inputs[:2],
        *refs,
        loss_type="dpo" if loss_type == "cdpo" else loss_type,
        beta=beta,
        label_smoothing=eps,
        simpo_gamma=gamma,
        discopop_tau=tau,
    )
    assert losses.dtype == torch.float32 and losses.shape == (n,)
    # float32 against float64 by hand: a few roundings of order-1 terms (F32_REL), also where a loss
    # nears 0 (hinge, sft).
    assert losses.tolist() == pytest.approx(expected, rel=F32_REL, abs=F32_REL)
    if loss_type != "sft":  # its loss is all in chosen_nll: nothing to differentiate here
        losses.sum().backward()
        assert all(torch.isfinite(x.grad).all() for x in inputs)
    assert LossConfig(loss=loss_type if loss_type != "cdpo" else "dpo").reference_free == free
    base_c, base_r = ([0.0] * n, [0.0] * n) if free else (rc, rr)
    assert cr.tolist() == pytest.approx([beta * (a - c) for a, c in zip(pc, base_c)], rel=F32_REL)
    assert rj.tolist() == pytest.approx([beta * (b - d) for b, d in zip(pr, base_r)], rel=F32_REL)


def test_chosen_nll_is_the_token_mean_however_the_batch_is_split():
    from loss import chosen_nll

    values, tokens = torch.tensor([-6.0, -2.0, -9.0, -3.0]), torch.tensor([3, 1, 6, 2])
    token_mean = -values.sum() / tokens.sum()  # 20 / 12
    per_pair = tokens.sum().item() / 4
    halves = torch.cat(
        [chosen_nll(values[:2], per_pair), chosen_nll(values[2:], per_pair)]
    )  # two micro-batches
    assert halves.mean().item() == pytest.approx(token_mean.item(), rel=F32_REL)


def test_sigmoid_is_dpo_by_its_canonical_name():
    # Resolved to "dpo": a checkpoint saved under either name resumes under the other.
    assert LossConfig(loss=("sigmoid",)).loss == ("dpo",)
    assert LossConfig(loss="sigmoid") == LossConfig(loss="dpo")
    assert LossConfig(loss=("sigmoid", "sft")).loss == ("dpo", "sft")
    logps = [torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])]
    refs = [torch.tensor([-1.5, -2.0]), torch.tensor([-1.5, -2.0])]
    for got, want in zip(
        preference_loss(*logps, *refs, loss_type="sigmoid", label_smoothing=0.1),
        preference_loss(*logps, *refs, loss_type="dpo", label_smoothing=0.1),
    ):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="is not one of dpo, sigmoid"):
        LossConfig(loss="logistic")


@pytest.mark.parametrize(
    "argv, resolved",
    [(["--loss", "sigmoid"], ("dpo",)), (["--loss", "sigmoid", "--loss", "sft"], ("dpo", "sft"))],
)
def test_sigmoid_parses_as_train_dpo_main_reads_the_command_line(argv, resolved):
    cfg = tyro.cli(train_dpo.Config, args=argv, config=(tyro.conf.UseAppendAction,))
    assert cfg.objective.loss == resolved
    # As saved in a checkpoint and compared on resume.
    assert dataclasses.asdict(cfg.objective) == dataclasses.asdict(LossConfig(loss=resolved))


def test_rewards_are_detached_and_no_reference_reads_as_zero():
    pc = torch.tensor([-1.0], requires_grad=True)
    losses, cr, rr = preference_loss(
        pc, torch.tensor([-2.0]), torch.tensor([-1.0]), torch.tensor([-1.0])
    )
    assert losses.requires_grad and not cr.requires_grad and not rr.requires_grad
    # --ref none (CPO): the reference's log-probs are 0.
    free = preference_loss(pc, torch.tensor([-2.0]), None, None, loss_type="dpo")
    zero = preference_loss(pc, torch.tensor([-2.0]), torch.zeros(1), torch.zeros(1))
    assert [x.tolist() for x in free] == [x.tolist() for x in zero]


def test_step0_loss_is_ln2_and_rewards_zero():
    policy, tok = tiny(seed=3)
    reference = copy.deepcopy(policy).eval()
    pairs = tokenize(demo_pairs("train")[:6], tok, 128, 64)
    out = forward_pairs(policy, reference, collate_pairs(pairs, tok.pad_token_id), LossConfig())
    torch.testing.assert_close(out.losses, torch.full((6,), math.log(2)))
    assert out.chosen_rewards.eq(0).all() and out.rejected_rewards.eq(0).all()


@pytest.mark.parametrize("ipo_logps", ["mean", "sum"])
def test_ipo_takes_mean_or_summed_log_ratios(ipo_logps):
    policy, tok = tiny(seed=3)
    reference, _ = tiny(seed=4)  # another model, so the log-ratios are not 0
    pairs = tokenize(demo_pairs("train")[:4], tok)
    objective = LossConfig(loss="ipo", beta=0.5, ipo_logps=ipo_logps)
    assert objective.averages("ipo") == (ipo_logps == "mean")  # mean, TRL's, is the default
    assert LossConfig(loss="ipo").ipo_logps == "mean"
    with torch.no_grad():
        out = forward_pairs(
            policy.eval(), reference.eval(), collate_pairs(pairs, tok.pad_token_id), objective
        )

        def logp(model, pair, key):  # Hugging Face's own token-mean loss, one sequence at a time
            ids, labels = pair["prompt"] + pair[key], [-100] * len(pair["prompt"]) + pair[key]
            mean = -model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss.item()
            return mean if ipo_logps == "mean" else mean * len(pair[key])

        expected, bounds = [], []
        for p in pairs:
            logps = [logp(m, p, key) for key in ("chosen", "rejected") for m in (policy, reference)]
            h = (logps[0] - logps[1]) - (logps[2] - logps[3]) - 1 / (2 * 0.5)
            expected.append(h**2)
            # A small difference of four log-probs, each within LOGP_REL of itself; squared, the
            # loss moves by 2 |h| times that.
            bounds.append(2 * abs(h) * LOGP_REL * sum(map(abs, logps)))
    for got, want, bound in zip(out.losses.tolist(), expected, bounds, strict=True):
        assert got == pytest.approx(want, abs=bound)


@pytest.mark.parametrize("loss_type", ["dpo_norm", "simpo"])
def test_length_normalised_losses_take_each_responses_own_mean(loss_type):
    """dpo_norm and simpo see each response's log-prob divided by its own token count (and the
    reference's by the same): by hand on summed log-probs of responses of 3, 6, 9 and 2 tokens."""
    pc, pr, rc, rr = [-6.0, -12.0], [-9.0, -4.0], [-5.0, -10.0], [-8.0, -6.0]
    lengths = [3, 6, 9, 2]  # [chosen; rejected], as the step gives them
    beta, gamma = 0.5, 0.3
    objective = LossConfig(loss=loss_type, beta=beta, simpo_gamma=gamma)
    ref_logps = None if loss_type == "simpo" else torch.tensor(rc + rr)
    out = pair_losses(objective, torch.tensor(pc + pr), ref_logps, torch.tensor(lengths))
    expected = []
    for i in range(2):
        chosen, rejected = pc[i] / lengths[i], pr[i] / lengths[2 + i]
        if loss_type == "simpo":
            expected.append(-_logsig(beta * (chosen - rejected) - gamma))
        else:
            margin = (chosen - rc[i] / lengths[i]) - (rejected - rr[i] / lengths[2 + i])
            expected.append(-_logsig(beta * margin))
    assert out.losses.tolist() == pytest.approx(expected, rel=F32_REL)
    # The logged log-probs are the means too.
    assert out.chosen_logps.tolist() == pytest.approx([-2.0, -2.0])
    assert out.rejected_logps.tolist() == pytest.approx([-1.0, -2.0])


def test_rpo_as_a_loss_mix_adds_the_weighted_chosen_nll():
    policy, tok = tiny(seed=3)
    reference = copy.deepcopy(policy).eval()
    pairs = tokenize(demo_pairs("train")[:4], tok)
    batch = collate_pairs(pairs, tok.pad_token_id)
    per_pair = sum(len(p["chosen"]) for p in pairs) / 4
    with torch.no_grad():
        for loss in ("dpo", "dpo_norm"):  # summed and length-averaged log-probs
            plain = forward_pairs(policy, reference, batch, LossConfig(loss=loss))
            mix = LossConfig(loss=(loss, "sft"), loss_weights=(1, 0.5))  # RPO
            rpo = forward_pairs(policy, reference, batch, mix, tokens_per_pair=per_pair)
            hf = [
                policy(
                    input_ids=torch.tensor([p["prompt"] + p["chosen"]]),
                    labels=torch.tensor([[-100] * len(p["prompt"]) + p["chosen"]]),
                ).loss.item()
                * len(p["chosen"])
                for p in pairs
            ]  # each pair's summed NLL
            expected = [0.5 * x / per_pair for x in hf]
            # Each a summed NLL, ours against Hugging Face's: LOGP_REL.
            assert (rpo.losses - plain.losses).tolist() == pytest.approx(expected, rel=LOGP_REL)
        # SFT alone: the same NLL with weight 1, and only the 4 chosen rows go through the model
        # (its layout: each row's best response alone).
        best = collate_pairs(pairs, tok.pad_token_id, best_only=True)
        rows = []
        hook = policy.model.embed_tokens.register_forward_hook(
            lambda module, args, out: rows.append(len(args[0]))
        )
        sft = forward_pairs(policy, None, best, LossConfig(loss="sft"), tokens_per_pair=per_pair)
        hook.remove()
        assert rows == [4] and sft.losses.tolist() == pytest.approx(
            [x / per_pair for x in hf], rel=LOGP_REL
        )
    with pytest.raises(ValueError, match="--loss-weights: 1 weights for 2 --loss"):
        LossConfig(loss=("dpo", "sft"), loss_weights=(1.0,))


def _f_prime_by_hand(u, kind, a):
    """TRL's f'(t) at t = exp(u) = pi / pi_ref, written on t (f-DPO, Wang et al. 2023, Table 1)."""
    t = math.exp(u)
    return {
        "reverse_kl": u,
        "forward_kl": 1 - 1 / t,
        "js_divergence": math.log(2 * t / (1 + t)),
        "alpha_divergence": (t ** (a - 1) - 1) / (a - 1),
    }[kind]


@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"])
def test_a_loss_mix_under_an_f_divergence_with_wpo_weights_matches_hand_values_and_gradients(
    kind,
):
    # Three pairs, [chosen; rejected]: dpo on summed scores, ipo on per-token means and sft's NLL,
    # weighted.
    pc, pr, rc, rr = [-5.0, -7.0, -3.0], [-6.0, -4.0, -9.0], [-5.5, -6.0, -3.2], [-5.0, -4.5, -8.0]
    lengths, log_w, beta, a, per_pair = (
        [4, 6, 2, 5, 3, 7],
        [-0.3, -0.1, -0.5, -0.2, -0.4, -0.6],
        0.25,
        0.3,
        4.0,
    )
    objective = LossConfig(
        loss=("dpo", "ipo", "sft"),
        loss_weights=(1.0, 0.5, 0.25),
        beta=beta,
        f_divergence_type=kind,
        f_alpha_divergence_coef=a,
        use_weighting=True,
    )
    values = torch.tensor(pc + pr, requires_grad=True)
    out = pair_losses(
        objective,
        values,
        torch.tensor(rc + rr),
        torch.tensor(lengths),
        per_pair,
        torch.tensor(log_w),
    )

    def by_hand(x, i):  # pair i's loss from its [pc, pr], in float64
        c, r = _f_prime_by_hand(x[0] - rc[i], kind, a), _f_prime_by_hand(x[1] - rr[i], kind, a)
        dpo = -_logsig(beta * (c - r))
        ipo = (c / lengths[i] - r / lengths[3 + i] - 1 / (2 * beta)) ** 2
        return (dpo + 0.5 * ipo + 0.25 * -x[0] / per_pair) * math.exp(log_w[i] + log_w[3 + i])

    out.losses.sum().backward()
    for i in range(3):
        assert out.losses[i].item() == pytest.approx(by_hand([pc[i], pr[i]], i), rel=F32_REL)
        # Central differences in float64 stand in for the hand gradient: off by h^2 f''' / 6, about
        # 1e-9, far below float32's rounding of the order-1 terms of autograd's (F32_REL).
        h = 1e-4
        grads = [
            (
                by_hand([pc[i] + h * (k == 0), pr[i] + h * (k == 1)], i)
                - by_hand([pc[i] - h * (k == 0), pr[i] - h * (k == 1)], i)
            )
            / (2 * h)
            for k in range(2)
        ]
        assert [values.grad[i].item(), values.grad[3 + i].item()] == pytest.approx(
            grads, rel=F32_REL, abs=F32_REL
        )
        # Rewards: beta f' of the first preference loss's (summed) log-ratios; log-probs as given.
        # f' of an order-1 ratio may cancel to a small value (a log near 1): F32_REL of beta.
        for key, ratio in (("chosen_rewards", pc[i] - rc[i]), ("rejected_rewards", pr[i] - rr[i])):
            assert getattr(out, key)[i].item() == pytest.approx(
                beta * _f_prime_by_hand(ratio, kind, a), rel=F32_REL, abs=beta * F32_REL
            )
        assert out.chosen_logps[i].item() == pc[i] and out.rejected_logps[i].item() == pr[i]


def _listwise_at_zero(name, scores):
    """A listwise loss of one row when every reward is 0 (policy = reference), by hand:
    Plackett-Luce's each response chosen among itself and those scored lower, log(1 + lower);
    InfoNCA's log K; NCA's 2 log 2; LiPO's lambda weights (ranks by position) times log 2."""
    k = len(scores)
    if name == "plackett_luce":
        return sum(math.log(1 + sum(t < s for t in scores)) for s in scores)
    if name == "infonca":
        return math.log(k)
    if name == "nca":
        return 2 * math.log(2)
    d = [1 / math.log2(2 + i) for i in range(k)]
    return sum(
        abs(2 ** scores[i] - 2 ** scores[j]) * abs(d[i] - d[j]) * math.log(2)
        for i in range(k)
        for j in range(k)
        if scores[i] > scores[j]
    )


@pytest.mark.parametrize("name", ["plackett_luce", "infonca", "nca", "lipo"])
def test_listwise_losses_of_k_rows_at_equal_rewards_by_hand(name):
    """listwise_loss over a RowBatch of K_ROWS (K from 2 to 5, ties), every log-ratio 0."""
    rows = [
        {"prompt": [1], "responses": [[2]] * len(r["scores"]), "scores": r["scores"]}
        for r in K_ROWS
    ]
    rows = [{**r, "scores": [float(s) for s in r["scores"]]} for r in rows]
    batch = collate_rows(rows, pad_id=0)
    losses = listwise_loss(
        batch.by_row(torch.zeros(len(batch.response_rows))),
        batch.scores,
        ~batch.scores.isnan(),
        name,
    )
    expected = [_listwise_at_zero(name, r["scores"]) for r in rows]
    assert losses.tolist() == pytest.approx(expected, rel=F32_REL)


def test_a_listwise_loss_trains_from_its_value_at_equal_rewards(tmp_path, k_files):
    """Plackett-Luce in the trainer: step 1's loss is the rows' mean by hand, and after 3 steps the
    rewards rank the responses as the scores do more than not (at the start all 0: tau 0)."""
    out = run(
        tmp_path,
        "pl",
        *("--data", k_files[0], "--eval-data", k_files[0], "--loss", "plackett_luce"),
        *("--max-steps", "3", "--batch-size", str(len(K_ROWS)), "--lr", "1e-4"),
    )
    scores = [[float(s) for s in r["scores"]] for r in K_ROWS]
    expected = sum(_listwise_at_zero("plackett_luce", s) for s in scores) / len(K_ROWS)
    # A mean over 24 rows of sums of up to 5 float32 logs: a few dozen roundings, LOGP_REL.
    assert read_metrics(out)[0]["loss"] == pytest.approx(expected, rel=LOGP_REL)
    assert read_metrics(out, "eval")[-1]["rewards/kendall_tau"] > 0


LOSS_TYPES = ["plackett_luce", "infonca", "nca", "lipo"]
BETA, ALPHA = 0.5, 0.7
# Rows of (log-ratios, scores), None on padding: ties in score at the top (row 0), between the
# only two (row 3, whose rewards tie too) and around padding (row 2); a tie in reward (row 1: lipo's
# ranks break it by position); padding inside a row (row 2); a single response (row 4).
ROWS = [
    ([1.3, -0.4, 2.2, 0.7], [3.0, 1.0, 3.0, 2.0]),
    ([0.5, -1.2, 0.5, None], [0.5, 2.0, -1.0, None]),
    ([-0.3, None, 1.1, 0.2], [1.0, None, 1.0, 0.0]),
    ([0.8, 0.8, None, None], [2.0, 2.0, None, None]),
    ([2.0, None, None, None], [5.0, None, None, None]),
]


def _softmax(xs):
    top = max(xs)
    exps = [math.exp(x - top) for x in xs]
    return [e / sum(exps) for e in exps]


def _plackett_luce(r, s):
    # DPO App. A.3 on the ranking by score, descending: tau(k) is chosen among tau(k), ..., tau(K),
    # less the responses tied with it (the tie rule).
    tau = sorted(range(len(r)), key=s.__getitem__, reverse=True)
    nll = 0.0
    for k, i in enumerate(tau):
        choice = [tau[j] for j in range(k, len(r)) if j == k or s[tau[j]] < s[i]]
        nll -= r[i] - math.log(sum(math.exp(r[j]) for j in choice))
    return nll


def _infonca(r, s):
    w, p = _softmax([x / ALPHA for x in s]), _softmax(r)
    return -sum(wi * math.log(pi) for wi, pi in zip(w, p))


def _nca(r, s):
    w = _softmax([x / ALPHA for x in s])
    return -sum(wi * _logsig(ri) + _logsig(-ri) / len(r) for wi, ri in zip(w, r))


def _lipo(r, s):
    # LiPO-lambda: tau_i the 1-based rank of r_i, highest first (Python's sort keeps ties in order).
    tau = [0] * len(r)
    for position, i in enumerate(sorted(range(len(r)), key=r.__getitem__, reverse=True)):
        tau[i] = position + 1
    gain = [2**x - 1 for x in s]
    discount = [1 / math.log2(1 + t) for t in tau]
    return -sum(
        abs(gain[i] - gain[j]) * abs(discount[i] - discount[j]) * _logsig(r[i] - r[j])
        for i in range(len(r))
        for j in range(len(r))
        if s[i] > s[j]
    )


NAIVE = {"plackett_luce": _plackett_luce, "infonca": _infonca, "nca": _nca, "lipo": _lipo}


def _naive(loss_type, logratios, scores):
    """The row's loss in float64 from its valid entries' log-ratios and scores (lists)."""
    return NAIVE[loss_type]([BETA * x for x in logratios], scores)


def _batch(rows, pad_logratio=7.0, pad_score=-3.0):
    """(logratios, scores, valid), (B, K) each, from ROWS-like rows; logratios require grad."""
    valid = torch.tensor([[x is not None for x in lr] for lr, _ in rows])
    logratios = torch.tensor([[pad_logratio if x is None else x for x in lr] for lr, _ in rows])
    scores = torch.tensor([[pad_score if x is None else x for x in s] for _, s in rows])
    return logratios.requires_grad_(), scores, valid


def _valid_entries(row):
    logratios, scores = row
    return [x for x in logratios if x is not None], [x for x in scores if x is not None]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_losses_match_the_papers_formulas_by_hand(loss_type):
    logratios, scores, valid = _batch(ROWS)
    got = listwise_loss(logratios, scores, valid, loss_type, BETA, ALPHA)
    expected = torch.tensor([_naive(loss_type, *_valid_entries(row)) for row in ROWS])
    assert got.dtype == torch.float32 and got.shape == (len(ROWS),)
    torch.testing.assert_close(got, expected, rtol=F32_REL, atol=F32_REL)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradients_match_finite_differences_of_the_formulas(loss_type):
    # Offsets part the tied rewards: lipo's ranks, a step function, then hold still under +-h, and
    # its weights must carry no gradient for the two to agree.
    rows = [([None if x is None else x + 0.01 * j for j, x in enumerate(lr)], s) for lr, s in ROWS]
    logratios, scores, valid = _batch(rows)
    (grad,) = torch.autograd.grad(
        listwise_loss(logratios, scores, valid, loss_type, BETA, ALPHA).sum(), logratios
    )
    # float64 central differences: off by h^2 f''' and 2^-53 f / h, both far below float32's
    # rounding of autograd's order-1 terms (F32_REL).
    h = 1e-6
    for b, row in enumerate(rows):
        lr, s = _valid_entries(row)
        for i in range(len(lr)):
            up, down = list(lr), list(lr)
            up[i] += h
            down[i] -= h
            numeric = (_naive(loss_type, up, s) - _naive(loss_type, down, s)) / (2 * h)
            got = grad[b][valid[b]][i].item()
            assert got == pytest.approx(numeric, rel=F32_REL, abs=F32_REL), (b, i)
    assert (grad[~valid] == 0).all()


def _pairs(batch=6):
    """(B,) float64 policy and reference log-probs of chosen and rejected, requiring grad."""
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, generator=g, dtype=torch.float64) * 3 - 20).requires_grad_()
        for _ in range(4)
    ]


def _as_list(pc, pr, rc, rr, chosen_scores):
    """(B, 2) log-ratios and scores of pairs, the chosen one first in even rows, second in odd
    ones: the scores, not the column, say which is chosen."""
    chosen, rejected = pc.float() - rc.float(), pr.float() - rr.float()
    odd = torch.arange(len(pc)) % 2 == 1
    logratios = torch.stack([chosen, rejected], -1)  # (B, 2)
    scores = torch.tensor(chosen_scores).expand(len(pc), 2)  # (B, 2)
    return torch.where(odd[:, None], logratios.flip(-1), logratios), torch.where(
        odd[:, None], scores.flip(-1), scores
    )


@pytest.mark.parametrize(
    "loss_type, pair_type, chosen_scores, alpha",
    [
        ("plackett_luce", "dpo", (2.0, -1.0), 1.0),
        # One-hot targets: alpha -> 0 (exp(-1000) is 0 in float32), or scores far apart.
        ("infonca", "dpo", (1.0, 0.0), 1e-3),
        ("nca", "nca_pair", (1.0, 0.0), 1e-3),
        ("nca", "nca_pair", (1e4, 0.0), 1.0),
    ],
)
def test_at_k2_listwise_losses_are_the_pairwise_ones(loss_type, pair_type, chosen_scores, alpha):
    inputs = _pairs()
    logratios, scores = _as_list(*inputs, chosen_scores)
    valid = torch.ones(scores.shape, dtype=torch.bool)
    got = listwise_loss(logratios, scores, valid, loss_type, beta=0.3, alpha=alpha)
    expected, _, _ = preference_loss(*inputs, loss_type=pair_type, beta=0.3)
    torch.testing.assert_close(got, expected)
    # float32 math on both sides, its gradients handed back in float64: float32's rounding of
    # order-1 terms (F32_REL), not float64's default bound.
    for a, b in zip(
        torch.autograd.grad(got.sum(), inputs), torch.autograd.grad(expected.sum(), inputs)
    ):
        torch.testing.assert_close(a, b, rtol=F32_REL, atol=F32_REL)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("pad", [(3e38, -3e38), (-1e30, 1e30), (math.nan, math.inf)])
def test_padding_never_changes_the_result(loss_type, pad):
    # A row with no response at all: loss 0, gradient 0.
    rows = ROWS + [([None] * 4, [None] * 4)]
    logratios, scores, valid = _batch(rows, 0.0, 0.0)
    clean = listwise_loss(logratios, scores, valid, loss_type, BETA, ALPHA)
    (clean_grad,) = torch.autograd.grad(clean.sum(), logratios)
    logratios, scores, valid = _batch(rows, *pad)
    padded = listwise_loss(logratios, scores, valid, loss_type, BETA, ALPHA)
    (padded_grad,) = torch.autograd.grad(padded.sum(), logratios)
    assert torch.equal(padded, clean) and torch.equal(padded_grad, clean_grad)
    assert (padded_grad[~valid] == 0).all() and padded[-1] == 0
    # Each row alone, its padding dropped (K = K_row), as in the batch.
    for b, row in enumerate(ROWS):
        lr, s = (torch.tensor([x]) for x in _valid_entries(row))
        alone = listwise_loss(lr, s, torch.ones(lr.shape, dtype=torch.bool), loss_type, BETA, ALPHA)
        torch.testing.assert_close(alone[0], padded[b], rtol=F32_REL, atol=0)


def test_unpaired_orpo_and_cpo_losses_match_the_formulas_by_hand():
    """KTO (its KL estimate too), APO-zero-unpaired, ORPO (its NLL of prompt and chosen response)
    and CPO's losses with AlphaPO's rewards, from given log-probs, by hand in float64."""
    beta = 0.2
    # KTO: 3 scored responses (desirable, not, desirable), 3 mismatched; log-ratios.
    h = [0.7, -0.4, 1.5, 2.0, -1.0, 0.5]
    kl = max(sum(h[3:]) / 3, 0.0)
    desirable = torch.tensor([True, False, True])
    config = LossConfig(loss="kto", beta=beta, desirable_weight=1.3, undesirable_weight=0.6)

    def unpaired(h, config, mismatched=3):  # the trainer's reference point (one rank), then KTO
        h = torch.tensor(h)
        kl = h[3:].mean().clamp(min=0) if mismatched else torch.zeros(())
        none = torch.zeros(0, dtype=torch.long)
        return loss.response_losses(config, h[:3], h[:3], desirable, kl, none, none)

    out = unpaired(h, config)
    expected = [
        1.3 * (1 - _sig(beta * (h[0] - kl))),
        0.6 * (1 - _sig(beta * (kl - h[1]))),
        1.3 * (1 - _sig(beta * (h[2] - kl))),
    ]
    assert out.losses.tolist() == pytest.approx(expected, rel=F32_REL)
    assert out.kl.item() == pytest.approx(kl, rel=F32_REL)
    assert out.response_rewards.tolist() == pytest.approx([beta * x for x in h[:3]], rel=F32_REL)
    # A negative estimate counts as 0; APO-zero-unpaired has none.
    negative = unpaired([0.7, -0.4, 1.5, -2.0, -1.0, 0.5], config)
    assert negative.kl.item() == 0
    apo = unpaired(h, LossConfig(loss="apo_zero_unpaired", beta=beta), mismatched=0)
    assert apo.losses.tolist() == pytest.approx(
        [1 - _sig(beta * h[0]), _sig(beta * h[1]), 1 - _sig(beta * h[2])], rel=F32_REL
    )
    # Pairs: summed log-probs [chosen; rejected], response lengths, each pair's prompt's log-prob.
    chosen, rejected, lengths = [-6.0, -9.0], [-8.0, -5.0], [4, 5, 2, 5]
    prompts, tokens_per_pair = [-3.0, -2.5], 7.0
    values = torch.tensor(chosen + rejected)

    def pair(*names, weights=(), prompt=None, **options):
        config = LossConfig(loss=names, loss_weights=weights, beta=beta, **options)
        return loss.pair_losses(
            config, values, None, torch.tensor(lengths), tokens_per_pair, None, prompt
        ).losses.tolist()

    mc = [c / n for c, n in zip(chosen, lengths[:2])]
    mr = [r / n for r, n in zip(rejected, lengths[2:])]

    def odds(x):
        return x - math.log(1 - math.exp(x))

    nll = [-(c + p) / tokens_per_pair for c, p in zip(chosen, prompts)]
    orpo = [n - beta * _logsig(odds(a) - odds(b)) for n, a, b in zip(nll, mc, mr)]
    assert pair("orpo", prompt=torch.tensor(prompts)) == pytest.approx(orpo, rel=F32_REL)
    # CPO: sigmoid (dpo --ref none) with its NLL weighted 0.5, hinge, ipo and simpo on means.
    sums = [c - r for c, r in zip(chosen, rejected)]
    cpo = [-_logsig(beta * s) + 0.5 * -c / tokens_per_pair for s, c in zip(sums, chosen)]
    assert pair("dpo", "sft", weights=(1, 0.5), ref="none") == pytest.approx(cpo, rel=F32_REL)
    assert pair("hinge", ref="none") == pytest.approx(
        [max(0, 1 - beta * s) for s in sums], rel=F32_REL
    )
    means = [a - b for a, b in zip(mc, mr)]
    ipo = [(m - 1 / (2 * beta)) ** 2 for m in means]
    assert pair("ipo", ref="none") == pytest.approx(ipo, rel=F32_REL)
    simpo = [-0.9 * _logsig(beta * m - 0.3) - 0.1 * _logsig(-(beta * m - 0.3)) for m in means]
    assert pair("simpo", simpo_gamma=0.3, label_smoothing=0.1) == pytest.approx(simpo, rel=F32_REL)
    # AlphaPO: rewards (1 - p^-alpha) / alpha of the mean per-token p.
    alpha = 0.25

    def reward(x):
        return (1 - math.exp(x) ** -alpha) / alpha

    alphapo = [-_logsig(beta * (reward(a) - reward(b)) - 0.3) for a, b in zip(mc, mr)]
    assert pair("simpo", simpo_gamma=0.3, alphapo_alpha=alpha) == pytest.approx(
        alphapo, rel=F32_REL
    )


def test_kto_options_that_cannot_go_together_are_refused():
    cpo = LossConfig(loss=("hinge",), ref="none", cpo_alpha=0.5)
    assert (cpo.loss, cpo.loss_weights, cpo.cpo_alpha) == (("hinge", "sft"), (1.0, 0.5), 0.0)
    for options, message in [
        ({"loss": ("kto", "sft")}, "goes alone"),
        ({"loss": "kto", "ref": "none"}, "unpaired loss needs a reference"),
        ({"loss": "dpo", "alphapo_alpha": 0.5}, "--alphapo-alpha needs no reference"),
        ({"loss": "kto", "desirable_weight": -1.0}, "--desirable-weight"),
    ]:
        with pytest.raises(ValueError, match=message):
            LossConfig(**options)
    advice = loss.kto_weight_advice([True] * 30 + [False] * 10, LossConfig(loss="kto"))
    # TRL's ranges for 30 desirable, 10 undesirable: desirable weight in [10/30, 1.33 x 10/30].
    assert "--desirable-weight in [0.33, 0.44] or --undesirable-weight in [2.26, 3.0]" in advice
    assert (
        loss.kto_weight_advice(
            [True] * 30 + [False] * 10, LossConfig(loss="kto", undesirable_weight=2.5)
        )
        == ""
    )
    assert loss.kto_weight_advice([True, False] * 10, LossConfig(loss="kto")) == ""


# ----------------------------------------------------------------------------------------- logps.py
# Response log-probs against naive float32 and Hugging Face, the fused head, shared and K rows.


def _naive_logps(logits, labels, average):
    logp = logits.float().log_softmax(-1)[:, :-1]  # (B, T-1, V)
    target = labels[:, 1:]
    mask = target != -100
    tok = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    return tok.sum(-1) / (mask.sum(-1).clamp(min=1) if average else 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("average", [False, True])
def test_sequence_logps_values_and_gradients_match_naive_float32(dtype, average, device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g).to(dtype)
    labels = torch.randint(0, 11, (3, 7), generator=g)
    labels[0, :3] = -100
    labels[1, 5:] = -100
    labels[2, :] = -100  # a row with nothing to count gives 0
    a, b = (
        logits.clone().to(device).requires_grad_(),
        logits.clone().requires_grad_(),
    )  # the naive one on CPU
    ours, naive = sequence_logps(a, labels.to(device), average), _naive_logps(b, labels, average)
    assert ours.dtype == torch.float32 and ours.device.type == device and ours[2].item() == 0.0
    # Sums of up to 6 log-probs over 11 logits: F32_REL. On a GPU, whose exp and log round to a few
    # ulps and which sums in another order, LOGP_REL.
    tol = F32_REL if device == "cpu" else LOGP_REL
    torch.testing.assert_close(ours.cpu(), naive, rtol=tol, atol=tol)
    weights = torch.tensor([1.0, -2.0, 3.0])
    (ours * weights.to(device)).sum().backward()
    (naive * weights).sum().backward()
    # Elements weight x (probability - one-hot), under 3: a few roundings of order-1 terms. In bf16
    # both are the same float32 gradient rounded to bf16 alike.
    torch.testing.assert_close(a.grad.float().cpu(), b.grad.float(), rtol=LOGP_REL, atol=F32_REL)
    with pytest.raises(ValueError, match="must agree on"):  # inputs on two devices: one clear error
        sequence_logps(a.detach(), labels.to("meta"))


@needs_cuda
def test_log_probs_repeat_bit_for_bit_on_cuda():
    # Each row's token log-probs are summed in order, without atomics (index_add_ on CUDA adds in
    # any order): long rows, where atomics would round differently from call to call.
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(2, 200_000, 8, device="cuda", generator=g)
    labels = torch.randint(0, 8, (2, 200_000), device="cuda", generator=g)
    first = sequence_logps(logits, labels)
    assert all(torch.equal(sequence_logps(logits, labels), first) for _ in range(20))
    model, tok = tiny(seed=0)
    batch = collate_pairs(tokenize(demo_pairs("eval")[:16], tok, 512, 256), tok.pad_token_id).to(
        "cuda"
    )
    with torch.no_grad():
        assert torch.equal(response_logps(model.cuda(), batch), response_logps(model, batch))


def test_sequence_logps_matches_hugging_face_loss():
    model, _ = tiny(seed=1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (3, 20), generator=g)
    labels = ids.clone()
    labels[:, :6] = -100  # prompt
    labels[1, 15:] = -100  # padding
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        ours = sequence_logps(logits, labels, average=True)
        for i in range(3):  # HF's loss is the token mean of the shifted cross-entropy
            hf = model(input_ids=ids[i : i + 1], labels=labels[i : i + 1]).loss
            assert ours[i].item() == pytest.approx(-hf.item(), rel=LOGP_REL)
        total = sequence_logps(logits, labels).sum() / (labels[:, 1:] != -100).sum()
        assert total.item() == pytest.approx(
            -model(input_ids=ids, labels=labels).loss.item(), rel=LOGP_REL
        )


@needs_cuda_bf16
def test_the_fused_head_on_cuda_takes_float32_logits_from_a_bf16_output_layer():
    """Logits of 16-32 rounded to bf16 move by up to 0.0625: the per-token log-probs must come from
    float32 logits."""
    from logps import _TokenLogps

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(512, 256, device="cuda", generator=g).bfloat16()  # (N, H) hidden states
    w = (
        torch.randn(4096, 256, device="cuda", generator=g) * 1.5
    ).bfloat16()  # (V, H): logits of about +-24
    targets = torch.randint(0, 4096, (512,), device="cuda", generator=g)
    oracle = (
        (h.double() @ w.double().T).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    )  # (N,)
    rounded = (
        (h @ w.T).double().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    )  # the bf16 logits' error
    error = (_TokenLogps.apply(h, None, targets, w, False).double() - oracle).abs().max().item()
    bf16_error = (rounded - oracle).abs().max().item()
    print(f"per-token log-prob error: {error:.2e} float32 logits, {bf16_error:.2e} bf16")
    assert error < 1e-3 < (rounded - oracle).abs().max().item()


@pytest.mark.parametrize("head", ["fused", "with_bias"])
def test_padded_batch_log_probs_equal_unpadded_rows_and_the_head_sees_only_response_tokens(
    head, monkeypatch
):

    config, tok = tiny_config()
    policy = tiny_model(config, 2)
    monkeypatch.setattr(logps, "FUSED_HEAD_ON_CPU", True)  # the GPU path, here on the CPU
    if (
        head == "with_bias"
    ):  # a head with extras runs itself on the gathered positions, then the log-softmax
        policy.lm_head.bias = torch.nn.Parameter(torch.randn(len(tok)) * 0.1)
    add_scored_head(policy)
    texts = [
        {
            "prompt": "Review the red kettle:",
            "chosen": " Great. 5/5",
            "rejected": " The kettle is bad. 1/5",
        },
        {
            "prompt": "Hi",
            "chosen": " A much longer and more detailed answer here.",
            "rejected": " No.",
        },
        {"prompt": "Rate the lamp please:", "chosen": "!", "rejected": " meh"},
    ]
    pairs = tokenize(texts, tok, 128, 64)
    batch = collate_pairs(pairs, tok.pad_token_id)
    seen, token_logps, linear = [], _TokenLogps.apply, torch.nn.Linear.forward

    def record_linear(module, x):  # what reaches the vocabulary projection as a plain matmul
        if module is policy.lm_head:
            seen.append(("matmul", tuple(x.shape)))
        return linear(module, x)

    def record_logps(x, index, targets, weight, squares):
        seen.append(("fused" if weight is not None else "log-softmax", tuple(x.shape)))
        return token_logps(x, index, targets, weight, squares)

    monkeypatch.setattr(torch.nn.Linear, "forward", record_linear)
    monkeypatch.setattr(_TokenLogps, "apply", staticmethod(record_logps))
    out = forward_pairs(policy, None, batch, LossConfig(loss="simpo"))
    scored = sum(len(p[k]) for p in pairs for k in ("chosen", "rejected"))
    # Every scored token once, no prompt or padding position; fused, no (N, V) logits exist at all.
    if head == "fused":
        assert seen == [("fused", (scored, 128))]
    else:
        assert seen == [("matmul", (scored, 128)), ("log-softmax", (scored, len(tok)))]
    naive = []
    for i, p in enumerate(pairs):
        for key in ("chosen", "rejected"):
            ids = torch.tensor([p["prompt"] + p[key]])
            labels = torch.tensor([[-100] * len(p["prompt"]) + p[key]])
            alone = _naive_logps(
                policy(input_ids=ids).logits, labels, average=True
            )  # no padding at all
            torch.testing.assert_close(
                getattr(out, f"{key}_logps")[i], alone[0].detach(), rtol=LOGP_REL, atol=LOGP_REL
            )
            naive.append(alone[0] * len(p[key]))
    # The gradients of the summed log-probs, for every weight, against the naive float32
    # log_softmax's.
    params = list(policy.parameters())
    ours = torch.autograd.grad(response_logps(policy, batch).sum(), params)
    _assert_close_at_scale(ours, torch.autograd.grad(sum(naive), params), LOGP_REL)


def test_chunked_logps_match_naive_across_chunk_boundaries_and_save_no_float_copy(monkeypatch):

    monkeypatch.setattr(logps, "_chunk_rows", lambda vocab, device, matmul=False: 3)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 9, 50, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, 50, (4, 9), generator=g)
    labels[:, :3] = -100
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ours = sequence_logps(a, labels)
    naive = _naive_logps(b, labels, average=False)
    # Sums of 6 log-probs over 50 logits: F32_REL.
    torch.testing.assert_close(ours, naive, rtol=F32_REL, atol=F32_REL)
    ours.sum().backward()
    naive.sum().backward()
    torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=0, atol=0)
    # Besides the logits themselves, forward keeps O(tokens) tensors, never an (N, V) float32 copy.
    extra = sum(t.numel() for t in saved if t.data_ptr() != a.data_ptr())
    assert extra < 10 * labels.numel() < a.numel()


def _head_rel(dtype):
    """The fused head's log-probs and gradients against float32 on the same values, at the
    tensor's scale: in float32, a log-softmax over V and sums over N and H (LOGP_REL); in bf16, the
    gradients and the probabilities they sum round to bf16, each by up to half of BF16_EPS."""
    return LOGP_REL if dtype == torch.float32 else 2 * BF16_EPS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_log_probs_match_float32_oracle_across_chunks_and_keep_no_logits(
    dtype, monkeypatch
):

    # 10 rows in chunks of 3: 4 chunks, the last partial
    monkeypatch.setattr(logps, "_chunk_rows", lambda vocab, device, matmul=False: 3)
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(10, 16, generator=g), torch.randn(50, 16, generator=g) * 0.3
    targets = torch.randint(0, 50, (10,), generator=g)
    h, w = hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
    h32, w32 = (
        h.detach().float().requires_grad_(),
        w.detach().float().requires_grad_(),
    )  # the same values
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ours = _TokenLogps.apply(h, None, targets, w, False)
    oracle = (h32 @ w32.T).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    assert ours.dtype == torch.float32
    _assert_close_at_scale([ours], [oracle], _head_rel(dtype))
    grad = torch.randn(10, generator=g)
    ours.backward(grad)
    oracle.backward(grad)
    assert h.grad.dtype == w.grad.dtype == dtype
    _assert_close_at_scale([h.grad.float()], [h32.grad], _head_rel(dtype))
    _assert_close_at_scale([w.grad.float()], [w32.grad], _head_rel(dtype))
    # Forward keeps its inputs and the (N,) log-sum-exp: no (N, V) logits.
    assert (
        sum(t.numel() for t in saved if t.data_ptr() not in (h.data_ptr(), w.data_ptr())) == 2 * 10
    )


# The fused head's tests: vocabulary V, hidden size H, scored tokens N.
HEAD_V = 2000
HEAD_H = 128
HEAD_N = 40


class _LiveBytes(TorchDispatchMode):
    """Counts the storages that ops make while it is on (not those they write into or view): the
    peak of their bytes alive at once, and then each one's (bytes, dtype)."""

    def __init__(self):
        super().__init__()
        self.live = {}
        self.now = 0
        self.peak = 0
        self.at_peak = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_args = tree_flatten((args, kwargs))[0]
        inputs = {a.untyped_storage().data_ptr() for a in flat_args if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key in self.live:
                self.live[key][1] += 1
            elif key in inputs:
                continue
            else:
                self.live[key] = [t.untyped_storage().nbytes(), 1, t.dtype]
                self.now += self.live[key][0]
                if self.now > self.peak:
                    self.peak = self.now
                    self.at_peak = sorted((n, dtype) for n, _, dtype in self.live.values())
            weakref.finalize(t, self._drop, key)
        return out

    def _drop(self, key):
        self.live[key][1] -= 1
        if self.live[key][1] == 0:
            self.now -= self.live.pop(key)[0]


def _small_chunks(vocab, device, matmul=False):
    """logps._chunk_rows for a float32 chunk of 2**14 elements: of the (N, V) scores, 5 chunks of 8
    rows, or 5 blocks of 409 vocabulary rows (the last 364)."""
    return max(1, 2**14 // vocab)


def _head(dtype, n=HEAD_N):
    """(hidden (n, H), weight (V, H), targets (n,), grad (n,)), the first two in `dtype`."""
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(n, HEAD_H, generator=g).to(dtype)
    weight = (torch.randn(HEAD_V, HEAD_H, generator=g) * 0.3).to(dtype)
    return hidden, weight, torch.randint(0, HEAD_V, (n,), generator=g), torch.randn(n, generator=g)


def _float32_grads(hidden, weight, targets, grad):
    """The gradients of grad . log_softmax(hidden @ weight.T)[targets], all of it in float32."""
    h32 = hidden.float().requires_grad_()
    w32 = weight.float().requires_grad_()
    logps = (h32 @ w32.T).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    return torch.autograd.grad(logps, (h32, w32), grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_backward_makes_no_vocab_sized_tensor_but_the_weight_gradient(
    dtype, monkeypatch
):
    """Summed chunk by chunk over the rows, the weight's gradient held a float32 (V, H) sum and a
    (V, H) part per chunk, the last two at once; by vocabulary blocks, each block of the gradient is
    one matmul over all rows, made in place."""
    monkeypatch.setattr(logps, "_chunk_rows", _small_chunks)
    hidden, weight, targets, grad = _head(dtype)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    values = _TokenLogps.apply(h, None, targets, w, False)
    live = _LiveBytes()
    with live:
        values.backward(grad)
    h32_grad, w32_grad = _float32_grads(hidden, weight, targets, grad)
    assert h.grad.dtype == w.grad.dtype == dtype
    _assert_close_at_scale([h.grad.float()], [h32_grad], _head_rel(dtype))
    _assert_close_at_scale([w.grad.float()], [w32_grad], _head_rel(dtype))
    # At the peak, of all that holds as much as a bf16 (V, H): the weight's gradient alone.
    assert [(n, d) for n, d in live.at_peak if n >= HEAD_V * HEAD_H * 2] == [
        (HEAD_V * HEAD_H * w.itemsize, dtype)
    ]
    gradients = (HEAD_V + HEAD_N) * HEAD_H * w.itemsize
    assert live.peak - gradients < HEAD_V * HEAD_H * 2, (live.peak, gradients)


def test_fused_head_backward_of_a_frozen_weight_or_no_tokens(monkeypatch):
    """A frozen output layer (LoRA's) gets no gradient, and none is made; no scored tokens give zero
    gradients."""
    monkeypatch.setattr(logps, "_chunk_rows", _small_chunks)
    hidden, weight, targets, grad = _head(torch.float32)
    h = hidden.clone().requires_grad_()
    values = _TokenLogps.apply(h, None, targets, weight, False)
    live = _LiveBytes()
    with live:
        values.backward(grad)
    torch.testing.assert_close(h.grad, _float32_grads(hidden, weight, targets, grad)[0])
    assert weight.grad is None and max(n for n, _ in live.at_peak) < HEAD_V * HEAD_H
    hidden, weight, targets, grad = _head(torch.float32, n=0)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    _TokenLogps.apply(h, None, targets, w, False).backward(grad)
    assert h.grad.shape == (0, HEAD_H) and (w.grad is None or not w.grad.any())


def _shared_and_separate(model, pairs, objective, reference=None):
    """The pairs' log-probs and pair_losses of `pairs` in shared rows, then in separate rows."""
    outs = []
    for share in (True, False):
        batch = collate_pairs(pairs, pad_id=0, share_prompt=share)
        logps, ref, weights = side_logps(model, reference, batch, objective)
        out = pair_losses(objective, logps, ref, batch.response_lengths, log_weights=weights)
        outs.append((logps, weights, out.losses))
    return outs


# The kinds the shared-prompt tests build (_shared_config): each shares, by its probe.
SHARED_KINDS = (
    *("llama", "gemma", "gpt2", "gpt_neox", "mistral", "mixtral", "qwen3_moe", "qwen2"),
    *("qwen3", "gemma2", "opt"),
)


@pytest.mark.parametrize("kind", SHARED_KINDS)
def test_shared_rows_score_every_listed_model_as_separate_rows(kind):
    """Each model of SHARED_KINDS, float32 (its probe lets it share): log-probs (LD-DPO's), WPO's
    weights, losses and gradients in shared rows equal separate rows' within LOGP_REL, under its own
    attention (eager for Gemma 2, whose soft-capping needs it; SDPA otherwise)."""
    torch.manual_seed(0)
    model = add_scored_head(transformers.AutoModelForCausalLM.from_config(_shared_config(kind)))
    assert not models.shared_prompt_refusal(model.config, logps.shared_row_inputs)
    objective = LossConfig(loss=("dpo",), use_weighting=True, ld_alpha=0.5, ref="online")
    # The model is its own reference: log-ratios 0, so the losses' gradients are the log-probs'.
    (values, weights, losses), (logps2, weights2, losses2) = _shared_and_separate(
        model.eval(), _random_pairs(SHARED_LENGTHS), objective, reference=model
    )
    torch.testing.assert_close(values, logps2, rtol=LOGP_REL, atol=LOGP_REL)
    # WPO's log-weights: token means of log-probs minus log-sum-exps of order 5, near 0.
    torch.testing.assert_close(weights, weights2, rtol=LOGP_REL, atol=LOGP_REL)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.autograd.grad(x.sum(), params, allow_unused=True) for x in (losses, losses2)]
    _assert_close_at_scale(*grads, LOGP_REL)


def test_gemma2s_sliding_window_and_the_response_mask_both_matter_in_that_check():
    """The check above can fail: without the sliding window, or with the rejected tokens seeing
    the chosen ones, shared Gemma 2 rows score differently from separate ones."""
    torch.manual_seed(0)
    model = add_scored_head(transformers.AutoModelForCausalLM.from_config(_shared_config("gemma2")))
    pairs = _random_pairs(SHARED_LENGTHS)
    separate = response_logps(model, collate_pairs(pairs, pad_id=0))
    shared = collate_pairs(pairs, pad_id=0, share_prompt=True)
    # Each change moves the log-probs by far more than rounding: 100 times the check's bound.
    model.config.sliding_window = 10_000
    assert not torch.allclose(response_logps(model, shared), separate, atol=100 * LOGP_REL)
    model.config.sliding_window = 8
    torch.testing.assert_close(
        response_logps(model, shared), separate, rtol=LOGP_REL, atol=LOGP_REL
    )
    shared.segment_ids[shared.segment_ids == 2] = 1
    assert not torch.allclose(response_logps(model, shared), separate, atol=100 * LOGP_REL)


def test_three_steps_train_alike_shared_or_separate_on_five_architectures():
    """Llama, Qwen3, Gemma 2 (window 8, rows up to 33 tokens), GPT-2 and GPT-NeoX, float32: 3 AdamW
    steps of DPO against a frozen reference give the same per-step losses and gradient norms in
    shared and in separate rows, up to rounding (RUN_REL, GRAD_NORM_REL); step 1's loss is ln 2."""
    objective = LossConfig(loss=("dpo",), ref="online")
    for kind in ("llama", "qwen3", "gemma2", "gpt2", "gpt_neox"):
        runs = []
        for share in (True, False):
            torch.manual_seed(0)
            config = _shared_config(kind)
            policy = add_scored_head(transformers.AutoModelForCausalLM.from_config(config)).eval()
            reference = copy.deepcopy(policy).requires_grad_(False)
            optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
            history = []
            for step in range(3):
                pairs = _random_pairs(SHARED_LENGTHS, seed=step)
                batch = collate_pairs(pairs, pad_id=0, share_prompt=share)
                logps, ref, _ = side_logps(policy, reference, batch, objective)
                out = pair_losses(objective, logps, ref, batch.response_lengths)
                out.losses.mean().backward()
                norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                history += [out.losses.mean().item(), norm.item()]
            runs.append(history)
        assert runs[0][0] == pytest.approx(math.log(2), abs=F32_REL), kind
        # [loss, gradient norm] per step.
        assert runs[0][::2] == pytest.approx(runs[1][::2], rel=RUN_REL), kind
        assert runs[0][1::2] == pytest.approx(runs[1][1::2], rel=GRAD_NORM_REL), kind


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_rows_score_as_separate_rows_on_the_cpu(attention):
    """float32 on the CPU: each response's log-probs in packed rows (shared and separate, end to
    end in one row, a block-diagonal mask) against padded separate rows', within float32's
    rounding of a sum of log-probs (LOGP_REL)."""
    pairs = _random_pairs([(30, 6, 4), (20, 5, 8), (1, 3, 2)])
    config = _shared_config("llama")
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = add_scored_head(transformers.AutoModelForCausalLM.from_config(config)).eval()
    with torch.no_grad():
        expected = response_logps(model, collate_pairs(pairs, pad_id=0))
        for share in (True, False):
            packed = collate_pairs(pairs, pad_id=0, share_prompt=share, packing=True)
            assert packed.input_ids.shape == (1, packed.attention_mask.sum())
            torch.testing.assert_close(
                response_logps(model, packed), expected, rtol=LOGP_REL, atol=0
            )


@needs_cuda
def test_shared_rows_on_cuda_score_as_separate_rows_in_bf16_in_sdpa_and_flex_attention():
    """On a GPU, bf16: shared rows' and packed rows' log-probs against separate rows' (SDPA,
    causal, no mask) within bf16's rounding, in SDPA with the dense mask (what the trainer builds)
    and in FlexAttention with a block mask that skips blocks (what logps._mask gives a model built
    with it, as the trainer builds one with --packing on a GPU)."""
    from torch.nn.attention.flex_attention import BlockMask

    pairs = _random_pairs([(300, 60, 40), (200, 50, 80)])
    built = {}
    for attention in ("sdpa", "flex_attention"):
        config = _shared_config("llama")
        config._attn_implementation = attention
        torch.manual_seed(0)
        model = add_scored_head(transformers.AutoModelForCausalLM.from_config(config))
        built[attention] = model.to("cuda", torch.bfloat16).eval()
    assert built["sdpa"].config._attn_implementation == "sdpa"
    shared = collate_pairs(pairs, pad_id=0, share_prompt=True).to("cuda")
    mask = logps.shared_row_inputs(
        built["flex_attention"].config, shared.position_ids, shared.segment_ids
    )["attention_mask"]
    # Blocks masked whole (above the diagonal at least) are skipped: fewer computed than the 2 rows'
    # (blocks x blocks) of the 400-token rows.
    blocks = math.ceil(400 / mask.BLOCK_SIZE[0])
    computed = mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()
    assert isinstance(mask, BlockMask) and computed < 2 * blocks * blocks
    # Sums of 40 to 80 log-probs of about -6, each from activations rounded to bf16 in each
    # attention's own order: a few BF16_EPS of the sum.
    packed = collate_pairs(pairs, pad_id=0, share_prompt=True, packing=True).to("cuda")
    packed_mask = logps.shared_row_inputs(
        built["flex_attention"].config,
        packed.position_ids,
        packed.segment_ids,
        packed.document_ids,
    )["attention_mask"]
    # One row of 730 tokens: the other row's blocks are skipped too.
    blocks = math.ceil(730 / mask.BLOCK_SIZE[0])
    computed = packed_mask.kv_num_blocks.sum() + packed_mask.full_kv_num_blocks.sum()
    assert computed < blocks * (blocks + 1) // 2
    with torch.no_grad():
        expected = response_logps(built["sdpa"], collate_pairs(pairs, pad_id=0).to("cuda"))
        for model in built.values():
            for rows in (shared, packed):
                torch.testing.assert_close(
                    response_logps(model, rows), expected, rtol=3 * BF16_EPS, atol=0
                )


@pytest.mark.parametrize("head", ["unfused", "fused"])
def test_wpo_log_weights_and_ld_dpo_sums_match_a_naive_full_softmax_with_gradients(
    head, monkeypatch
):
    monkeypatch.setattr(logps, "FUSED_HEAD_ON_CPU", head == "fused")
    monkeypatch.setattr(
        logps, "_chunk_rows", lambda *args, **kwargs: 7
    )  # chunk edges inside responses
    policy, tok = tiny(seed=5)
    pairs = tokenize(demo_pairs("train")[4:8], tok)
    batch = collate_pairs(pairs, tok.pad_token_id)
    lengths = batch.response_lengths.tolist()
    assert len(set(lengths)) > 4  # chosen and rejected lengths differ: LD-DPO has tails to weigh
    params = [p for p in policy.parameters() if p.requires_grad]
    values, log_w = response_logps(policy, batch, ld_alpha=0.3, weighting=True)
    assert not log_w.requires_grad
    grads = torch.autograd.grad(values.sum(), params)
    # Outside response_logps the output layer gives plain logits, the whole (2B, T, V).
    token = torch.log_softmax(policy(input_ids=batch.input_ids).logits.float(), -1)  # (2B, T, V)
    naive, expected_w = [], []
    labels = hf_labels(batch, pairs)
    for row in range(len(lengths)):
        cols = (labels[row, 1:] != -100).nonzero().squeeze(-1)  # logits at t score token t + 1
        picked = token[row, cols, labels[row, cols + 1]]  # (length,)
        shared = min(lengths[row % 4], lengths[4 + row % 4])  # the pair's shorter response
        naive.append(picked[:shared].sum() + 0.3 * picked[shared:].sum())
        expected_w.append((picked - torch.logsumexp(2 * token[row, cols], -1)).mean().item())
    naive = torch.stack(naive)
    torch.testing.assert_close(values, naive.detach(), rtol=LOGP_REL, atol=LOGP_REL)
    assert log_w.tolist() == pytest.approx(expected_w, rel=LOGP_REL, abs=LOGP_REL)
    _assert_close_at_scale(grads, torch.autograd.grad(naive.sum(), params), LOGP_REL)
    # The reference gets LD-DPO's sums too; ld_alpha = 1 is the plain sum, bit for bit.
    reference, _ = tiny(seed=6)
    objective = LossConfig(ld_alpha=0.3)
    with torch.no_grad():
        _, ref_logps, none = side_logps(policy, reference, batch, objective)
        assert none is None and torch.equal(ref_logps, response_logps(reference, batch, 0.3))
        assert torch.equal(response_logps(policy, batch, 1.0), response_logps(policy, batch))


def _random_rows(ks, seed=0):
    """Rows of random ids, K responses each (ks), of unequal lengths, scores with a tie."""
    generator = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(1, 300, (n,), generator=generator).tolist()

    rows = []
    for i, k in enumerate(ks):
        lengths = [3 + (5 * j + 3 * i) % 9 for j in range(k)]
        scores = [float((j * 7 + i) % 4) for j in range(k)]
        scores[0] = max(scores) + 1 if len(set(scores)) < 2 else scores[0]
        rows.append(
            {
                "prompt": ids(1 + 4 * i % 11),
                "responses": [ids(n) for n in lengths],
                "scores": scores,
            }
        )
    return rows


def _as_pair_rows(rows, pairs="all"):
    """The pairs `rows` give, each its own row of 2 scored (1, 0)."""
    return [
        {
            "prompt": r["prompt"],
            "responses": [r["responses"][i], r["responses"][j]],
            "scores": [1.0, 0.0],
        }
        for r in rows
        for i, j in row_pairs(r["scores"], pairs)
    ]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2", "gpt2", "gpt_neox"])
def test_k_rows_score_as_their_pairs_written_out_on_five_architectures(kind):
    """float32, K from 2 to 5 per row: the per-pair losses (LD-DPO's log-probs, WPO's weights) and
    the mean loss's gradients of K rows, shared and separate, equal those of the same pairs as rows
    of 2 in separate rows (each response scored once per pair), up to the log-probs' LOGP_REL."""
    torch.manual_seed(0)
    model = add_scored_head(transformers.AutoModelForCausalLM.from_config(_shared_config(kind)))
    model.eval()
    reference = add_scored_head(transformers.AutoModelForCausalLM.from_config(_shared_config(kind)))
    reference.eval()
    objective = LossConfig(loss=("dpo",), use_weighting=True, ld_alpha=0.5, ref="online")
    rows = _random_rows([4, 2, 5, 3])
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for batch in (
        collate_rows(
            rows,
            pad_id=0,
            share_prompt=not models.shared_prompt_refusal(model.config, logps.shared_row_inputs),
        ),
        collate_rows(rows, pad_id=0),
        collate_rows(_as_pair_rows(rows), pad_id=0),
    ):
        values, ref, weights = side_logps(model, reference, batch, objective)
        out = pair_losses(
            objective, values, ref, batch.pair_sides(batch.response_lengths), None, weights
        )
        grads = torch.autograd.grad(out.losses.mean(), params, allow_unused=True)
        results.append((out.losses.detach(), weights, grads))
    assert len(results[0][0]) == sum(len(row_pairs(r["scores"])) for r in rows)
    # A loss moves by beta times its margin's error: four log-probs, each within LOGP_REL of itself.
    # WPO's log-weights, token means of log-probs minus log-sum-exps of order 5, near 0: LOGP_REL.
    largest = torch.cat([values, ref]).abs().max().item()
    loss_atol = 4 * objective.beta * LOGP_REL * largest
    for losses, weights, grads in results[:2]:
        torch.testing.assert_close(losses, results[2][0], rtol=0, atol=loss_atol)
        torch.testing.assert_close(weights, results[2][1], rtol=LOGP_REL, atol=LOGP_REL)
        _assert_close_at_scale(grads, results[2][2], LOGP_REL)


@pytest.mark.parametrize("objective", ["orpo", "kto"])
def test_orpo_and_kto_score_shared_rows_as_separate_ones_and_as_pairs_written_out(objective):
    """float32, K from 2 to 5 per row: ORPO's losses (its NLL scores the prompts too) and KTO's
    (its mismatched completions ride in their rows), and the mean loss's gradients, are the same
    in shared rows and in a row per response; ORPO's as over the same pairs as rows of 2."""
    torch.manual_seed(0)
    model = add_scored_head(transformers.AutoModelForCausalLM.from_config(_shared_config("llama")))
    reference = add_scored_head(
        transformers.AutoModelForCausalLM.from_config(_shared_config("llama"))
    )
    rows = _random_rows([4, 2, 5, 3])
    config = LossConfig(loss=objective)
    layouts = [{"share_prompt": True}, {}]
    if objective == "kto":
        tokens = data.RowTokens(
            torch.tensor(
                [t for r in rows for part in (r["prompt"], *r["responses"]) for t in part]
            ),
            torch.tensor(
                [
                    [len(r["prompt"])]
                    + [len(x) for x in r["responses"]]
                    + [0] * (5 - len(r["responses"]))
                    for r in rows
                ]
            ),
            torch.tensor([r["scores"] + [math.nan] * (5 - len(r["scores"])) for r in rows]),
        )
        paired = data.with_mismatched(tokens, 512)
        rows = [paired[i] for i in range(len(paired))]
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for batch, layout in [(rows, layout) for layout in layouts] + [
        (_as_pair_rows(rows), {}) for _ in range(objective == "orpo")
    ]:
        rb = collate_rows(batch, 0, score_prompts=objective == "orpo", **layout)
        with world_of_one():  # KTO's reference point is reduced over the ranks
            # ORPO is reference-free: the trainer builds no reference for it.
            ref_model = reference if objective == "kto" else None
            out = train_dpo.micro_batch_loss(config, model, ref_model, rb, None, 5.0)
        grads = torch.autograd.grad(out.losses.sum(), params, allow_unused=True)
        results.append((out.losses.detach(), grads))
    for losses, grads in results[1:]:
        torch.testing.assert_close(losses, results[0][0], rtol=LOGP_REL, atol=LOGP_REL)
        _assert_close_at_scale(grads, results[0][1], LOGP_REL)


# ------------------------------------------------------------------------------------ checkpoint.py
# Saving, resuming bit for bit, refusing another run's checkpoint, and stopping on a signal.


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_saving_in_the_background_is_reported_in_one_line(
    tmp_path, monkeypatch, capsys
):
    """--async-save: the disk fills while the background thread writes step 2: its failure is
    reported, not swallowed, in one line naming the folder, the last complete checkpoint and how to
    resume; step-2's partial folder removed, `latest` still at step 1; once there is room, --resume
    latest goes on from it. (A foreground save's: the test of a save that fails partway.)"""
    import checkpoint

    flags = ("--max-steps", "3", "--save-every", "1", "--micro-batch-size", "16", "--async-save")
    real, writes = checkpoint.dcp.async_save, []

    def write(state, checkpoint_id, **kwargs):  # step 1 is written; step 2 fills the disk
        writes.append(checkpoint_id)
        if len(writes) == 1:
            return real(state, checkpoint_id=checkpoint_id, **kwargs)
        pathlib.Path(checkpoint_id, "__0_0.distcp").write_bytes(b"partial")
        failed = concurrent.futures.Future()
        failed.set_exception(OSError(errno.ENOSPC, "No space left on device"))
        return failed

    monkeypatch.setattr(checkpoint.dcp, "async_save", write)
    with pytest.raises(SystemExit) as ended:
        run(tmp_path, "save", *flags)
    root = tmp_path / "save" / "checkpoints"
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip().split("\n")[-1] == (
        f"error: {root / 'step-2'}: not saved (OSError: [Errno 28] No space left on device); its "
        f"partial folder is removed. The last complete checkpoint: {root / 'step-1'}; once the "
        "disk has room, continue with --resume latest"
    )
    assert sorted(os.listdir(root)) == ["latest", "step-1"]
    assert (root / "latest").read_text() == "step-1"
    monkeypatch.undo()
    run(tmp_path, "save", *flags, "--resume", "latest")
    assert [r["step"] for r in read_metrics(tmp_path / "save")] == [1, 2, 3]


def test_a_damaged_checkpoint_is_refused_naming_the_previous_complete_one(tmp_path, capsys):
    """--resume of a checkpoint with a shard cut short, then of one missing its RNG file: one line
    naming it, what is wrong and the previous complete checkpoint (none before step 1); resuming
    from that one trains on."""
    flags = ("--max-steps", "3", "--save-every", "1", "--micro-batch-size", "16")
    out = run(tmp_path, "run", *flags, "--max-steps", "2")
    root = os.path.join(out, "checkpoints")
    (shard,) = glob.glob(os.path.join(root, "step-2", "*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    os.remove(os.path.join(root, "step-1", "rng-rank0.pt"))
    for spec, previous in (("latest", f"--resume {root}/step-1"), (f"{root}/step-1", "none")):
        with pytest.raises(SystemExit) as ended:
            run(tmp_path, "run", *flags, "--resume", spec)
        (line,) = [x for x in capsys.readouterr().err.split("\n") if x.startswith("error:")]
        assert ended.value.code == 2
        checkpoint = f"{root}/step-2" if spec == "latest" else spec
        assert line.startswith(f"error: --resume {checkpoint}: damaged checkpoint (")
        assert line.endswith(
            f"); the previous complete one: {previous}" + " is older" * (previous == "none")
        )
    shutil.copy(os.path.join(root, "step-2", "rng-rank0.pt"), os.path.join(root, "step-1"))
    run(tmp_path, "run", *flags, "--resume", f"{root}/step-1")
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_a_full_disk_while_tokenizing_or_exporting_ends_in_one_line_and_leaves_nothing_partial(
    tmp_path, monkeypatch, capsys
):
    """The token cache's disk fills (torch.save says so as a RuntimeError): one line naming the
    cache folder, no .tmp left. The export's disk fills: one line, no final/ folder."""
    real = torch.save

    def cut_short(obj, f, *args, **kwargs):
        pathlib.Path(f).write_bytes(b"partial")
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 2496 vs 2390"
        )

    cache = tmp_path / "cache"
    monkeypatch.setattr(torch, "save", cut_short)
    with pytest.raises(SystemExit) as ended:
        run(tmp_path, "tokens", "--max-steps", "1", "--cache-dir", str(cache))
    line = capsys.readouterr().err.strip().split("\n")[-1]
    assert ended.value.code == 2 and line.startswith(f"error: {cache}: cannot write tokens-")
    assert line.endswith(
        ".pt ([enforce fail at inline_container.cc:672] . unexpected pos 2496 vs 2390)"
    )
    assert not [name for name in os.listdir(cache) if name.endswith(".tmp")]
    monkeypatch.setattr(torch, "save", real)

    def partial_export(folder, *args):
        os.makedirs(folder)
        pathlib.Path(folder, "config.json").write_text("{}")
        _full_disk()

    monkeypatch.setattr(models, "save_pretrained", partial_export)
    with pytest.raises(SystemExit) as ended:
        run(tmp_path, "export", "--max-steps", "1")
    final = tmp_path / "export" / "final"
    assert ended.value.code == 2 and not final.exists()
    assert capsys.readouterr().err.strip().split("\n")[-1] == (
        f"error: {final}: the export failed ([Errno 28] No space left on device); it is removed"
    )


def _checkpoint_tensors(path, tmp_path):
    """A DCP checkpoint folder's full tensors: {"model", "optim", "reference"}."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, tmp_path / "state.pt")
    return torch.load(tmp_path / "state.pt", weights_only=False)


def test_tr_dpo_mixes_the_full_weights_and_a_resumed_run_is_bit_identical(objectives_run, tmp_path):
    ckpts = os.path.join(objectives_run, "checkpoints")
    reference = tiny_model(
        tiny_config()[0], seed=0
    ).state_dict()  # the reference at step 0: the initial policy
    for step in (2, 4):  # each sync: reference = 0.6 policy + 0.4 reference, on the whole tensors
        state = _checkpoint_tensors(os.path.join(ckpts, f"step-{step}"), tmp_path)
        for name, before in reference.items():
            expected = before.mul(1 - 0.6).add(state["model"][name], alpha=0.6)
            torch.testing.assert_close(state["reference"][name], expected, rtol=0, atol=0)
        reference = state["reference"]
    out = (
        tmp_path / "resumed"
    )  # step-2's checkpoint holds the synced reference: resuming reproduces every bit
    shutil.copytree(ckpts, out / "checkpoints")
    (out / "checkpoints" / "latest").write_text("step-2")
    (out / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in read_metrics(objectives_run)[:2])
    )
    run(tmp_path, "resumed", *OBJECTIVES, "--resume", "latest")
    _assert_same_run(objectives_run, str(out))


def test_resume_is_bit_identical_with_model_optimizer_schedule_data_and_rng(
    six_steps, tmp_path, monkeypatch
):
    full, full_draws = six_steps
    ckpts = os.path.join(full, "checkpoints")
    assert sorted(os.listdir(ckpts)) == [
        "latest",
        "step-4",
        "step-6",
    ]  # --keep-last 2 pruned step-2
    assert open(os.path.join(ckpts, "latest")).read() == "step-6"
    state = json.load(open(os.path.join(ckpts, "step-4", "trainer_state.json")))
    assert (
        state["data_position"] == {"epoch": 0, "rows_consumed": 64}
        and state["schedule"]["total_steps"] == 6
    )
    assert state["config"]["batching"]["batch_size"] == 16 and state["world_size"] == 1
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(ckpts, out / "checkpoints")
    (out / "metrics.jsonl").write_text(
        "".join(  # what the killed run had logged past its last checkpoint too
            json.dumps(r) + "\n" for r in read_metrics(full)[:5]
        )
    )
    draws = _record_randomness(monkeypatch)
    (out / "checkpoints" / "latest").write_text("step-4")
    run(tmp_path, "resumed", *SIX, "--resume", "latest")
    assert (
        draws == full_draws[2 * 4 :]
    )  # (2 micro-batches a step) torch and Python generators continue as they were
    _assert_same_run(
        full, str(out)
    )  # metrics.jsonl holds each step once, identical to the uninterrupted run


@needs_cuda
def test_resume_on_cuda_is_bit_identical_and_restores_this_gpus_generator(tmp_path, monkeypatch):
    draws = _record_randomness(monkeypatch, cuda=True)
    full = run(tmp_path, "full", *SIX, "--save-every", "2", device="cuda")
    full_draws, out = list(draws), tmp_path / "resumed"
    draws.clear()
    shutil.copytree(os.path.join(full, "checkpoints"), out / "checkpoints")
    shutil.copy(
        os.path.join(full, "metrics.jsonl"), out / "metrics.jsonl"
    )  # resuming drops the rows past step 4
    (out / "checkpoints" / "latest").write_text("step-4")
    run(tmp_path, "resumed", *SIX, "--resume", "latest", device="cuda")
    assert draws == full_draws[2 * 4 :]
    _assert_same_run(full, str(out))


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_a_checkpoint_saved_seeing_two_gpus_resumes_seeing_one(tmp_path):
    out = str(tmp_path / "run")
    proc = torchrun(
        1,
        out,
        "--max-steps",
        "4",
        "--save-every",
        "2",
        device="cuda",
        env={"CUDA_VISIBLE_DEVICES": "0,1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    step2 = os.path.join(out, "checkpoints", "step-2")
    proc = torchrun(
        1,
        out,
        "--max-steps",
        "4",
        "--resume",
        step2,
        device="cuda",
        env={"CUDA_VISIBLE_DEVICES": "1"},
    )
    assert proc.returncode == 0 and "resumed from" in proc.stderr, proc.stderr[-3000:]


def test_a_save_that_fails_partway_leaves_the_previous_checkpoint_latest(
    tmp_path, monkeypatch, capsys
):
    """The disk fills while step 4 is saved in the foreground (its shards written, then DCP fails):
    one line naming the folder, the last complete checkpoint and how to resume; step-4's partial
    folder removed, `latest` still at step 2; once there is room, --resume latest goes on."""
    import checkpoint

    real, saves = checkpoint.dcp.save, []

    def failing_save(state, checkpoint_id, **kwargs):
        saves.append(checkpoint_id)
        # Shards on disk, but no rename or pointer.
        real(state, checkpoint_id=checkpoint_id, **kwargs)
        if len(saves) == 2:
            _full_disk()

    monkeypatch.setattr(checkpoint.dcp, "save", failing_save)
    with pytest.raises(SystemExit) as ended:
        run(tmp_path, "run", "--max-steps", "4", "--save-every", "2")
    ckpts = tmp_path / "run" / "checkpoints"
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip().split("\n")[-1] == (
        f"error: {ckpts / 'step-4'}: not saved (OSError: [Errno 28] No space left on device); its "
        f"partial folder is removed. The last complete checkpoint: {ckpts / 'step-2'}; once the "
        "disk has room, continue with --resume latest"
    )
    assert sorted(os.listdir(ckpts)) == ["latest", "step-2"]
    assert (ckpts / "latest").read_text() == "step-2" and not (tmp_path / "run" / "final").exists()
    monkeypatch.setattr(checkpoint.dcp, "save", real)
    out = run(tmp_path, "run", "--max-steps", "4", "--save-every", "2", "--resume", "latest")
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert sorted(os.listdir(ckpts)) == ["latest", "step-2", "step-4"]


def test_resume_refuses_a_different_run_and_exports_in_the_chosen_dtype(tmp_path, capsys):
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in demo_pairs("train")[:64]))
    on_data = ("--data", str(data))
    out = run(
        tmp_path,
        "run",
        *on_data,
        "--max-steps",
        "2",
        "--save-every",
        "2",
        "--export-dtype",
        "bfloat16",
    )
    from transformers import AutoModelForCausalLM

    exported = load_safetensors(os.path.join(out, "final"))
    assert {v.dtype for v in exported.values()} == {torch.bfloat16}
    assert AutoModelForCausalLM.from_pretrained(os.path.join(out, "final")).dtype == torch.bfloat16
    capsys.readouterr()
    resume = ["--out-dir", out, "--cache-dir", CACHE, "--batch-size", "16", "--no-warm-start"]
    resume += ON_CPU
    resume += ["--resume", "latest"]
    for args, message in (
        (["--batch-size", "8"], "--batch-size is 8 but the checkpoint was trained with 16"),
        (["--beta", "0.5"], "--beta is 0.5 but the checkpoint was trained with 0.1"),
        # another batch order for the rest of the epoch would repeat some pairs and skip others
        (
            ["--no-group-by-length"],
            "--group-by-length is False but the checkpoint was trained with True",
        ),
        (["--data", "demo"], "--data is ['demo'] but the checkpoint was trained with"),
    ):
        # A repeated --data appends: the checkpoint's data only where args name none.
        data_args = [] if "--data" in args else list(on_data)
        with pytest.raises(SystemExit) as exit_info:
            train_dpo.main([*resume, *data_args, *args])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and message in err and "\n" not in err, err
    # The same path, new content.
    data.write_text("".join(json.dumps(p) + "\n" for p in demo_pairs("train")[1:65]))
    with pytest.raises(SystemExit):
        train_dpo.main([*resume, *on_data])
    assert "the tokenized --data (its content, cut by this code) is" in capsys.readouterr().err
    # Settings that may change on resume: here the length of the run and the precision.
    data.write_text("".join(json.dumps(p) + "\n" for p in demo_pairs("train")[:64]))
    run(tmp_path, "run", *on_data, "--max-steps", "3", "--precision", "bf16", "--resume", "latest")
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def _different(value):
    """A value of the same kind that is not `value`, as JSON holds it."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return [*value, "other"]
    return 0.5


def test_resume_refuses_a_checkpoint_that_differs_in_any_setting_of_the_run():
    """Every key of train_dpo._SAME_RUN is one setting of the run (a single leaf of what a
    checkpoint records), and a checkpoint that differs there alone is refused, naming its flag."""
    import checkpoint

    current = json.loads(json.dumps(train_dpo._identity(train_dpo.Config(), {"train_sha256": "a"})))

    def leaves(tree, path=()):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from leaves(value, (*path, key))
            else:
                yield key, (*path, key)

    paths = {}
    for key, path in leaves(current):
        paths.setdefault(key, []).append(path)
    checkpoint.check_same_run(copy.deepcopy(current), current, train_dpo._SAME_RUN)
    for key, flag in train_dpo._SAME_RUN.items():
        assert len(paths[key]) == 1, (key, paths[key])
        saved = copy.deepcopy(current)
        *parents, leaf = paths[key][0]
        node = saved
        for parent in parents:
            node = node[parent]
        node[leaf] = _different(node[leaf])
        with pytest.raises(ValueError, match=f"^--resume: {re.escape(flag)} is "):
            checkpoint.check_same_run(saved, current, train_dpo._SAME_RUN)


PREEMPT = """
import os, signal, time
from unittest import mock
import fsdp_setup, models, train_dpo
real_init = fsdp_setup.init_distributed
real_find = models.find_weights
real_step = train_dpo.train_step
steps = [0]

def init_distributed(*args, **kwargs):  # collectives time out after 6 s
    return real_init(*args, timeout_s=6, **kwargs)

def find_weights(*args):  # rank 0's download takes longer than any collective may wait
    time.sleep(8)
    return real_find(*args)

def train_step(*args):  # SIGTERM to rank 1 alone, as step 3 starts
    steps[0] += 1
    if steps[0] == 3 and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGTERM)
    return real_step(*args)

def main(argv):  # patched for this run alone, its signal handlers put back after it
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        with (
            mock.patch.object(fsdp_setup, "init_distributed", init_distributed),
            mock.patch.object(models, "find_weights", find_weights),
            mock.patch.object(train_dpo, "train_step", train_step),
        ):
            train_dpo.main(argv)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
"""


# Tests of the background's first start (two_ranks): late in the file, as those of hsdp_runs and
# processes (before the packed grid's), so that the foreground's other tests run while the starts
# finish.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(request, tmp_path, device):
    """INJECT's overflow on the last rank: on CPU in two_ranks's "fp16" (two ranks), on CUDA in a
    start of its own (nccl, up to two GPUs)."""
    if device == "cpu":
        two_ranks = request.getfixturevalue("two_ranks")
        out, ranks = two_ranks[0]["fp16"], 2
        err = run_lines(two_ranks[1], out)
        assert [(r["error"], r["exit"]) for r in run_records(out, 2)] == [(None, None)] * 2, err
    else:
        script, out, ranks = tmp_path / "inject.py", tmp_path / "fp16", min(GPUS, 2)
        script.write_text(INJECT)
        proc = torchrun(ranks, str(out), *FP16_OVERFLOW, script=script, device=device)
        assert proc.returncode == 0, proc.stderr[-3000:]
        err = proc.stderr
    assert f"on {device}" in err and ("nccl" in err) == (device == "cuda")
    records = [json.load(open(out / f"record-{r}.json")) for r in range(ranks)]
    rows = read_metrics(out)
    # (fp16 from the default 2**16 scale overflows naturally at step 1; step 2 is a normal step.)
    assert [r["skipped"] for r in rows][1:] == [False, True, False]
    scales = [r["scale"] for r in records[0]]
    assert all(
        [r["scale"] for r in record] == scales for record in records
    )  # every rank backs off, at once
    assert scales[3] == scales[2] / 2 and rows[2]["loss_scale"] == scales[2] / 2
    for record in records:
        assert (
            record[1]["checksum"] != record[2]["checksum"]
        )  # step 2 updated this rank's shard ...
        assert record[2]["checksum"] == record[3]["checksum"]  # ... step 3 did not, on either rank
    assert "step 3: non-finite loss or gradient norm, step skipped on every rank" in err


def test_cpu_offload_trains_resumes_and_exports_as_without_it(six_steps, two_ranks, tmp_path):
    from torch.distributed.fsdp import FSDPModule

    with world_of_one():  # the trainer's build: every shard offloaded, unpinned on a CPU
        model, _, _ = sharded_tiny(seed=0, cpu_offload=True)
        groups = [
            m._get_fsdp_state()._fsdp_param_group
            for m in model.modules()
            if isinstance(m, FSDPModule)
        ]
        params = [p for group in groups if group for p in group.fsdp_params]
        assert params and all(p.offload_to_cpu and not p.pin_memory for p in params)
    plain, offload = two_ranks[0]["resumed"], two_ranks[0]["offload"]
    _assert_same_rows(read_metrics(plain), read_metrics(offload))
    wa, wb = load_safetensors(str(plain / "final")), load_safetensors(str(offload / "final"))
    assert wa.keys() == wb.keys() and all(
        torch.allclose(wa[k], wb[k], rtol=0, atol=ADAM_ATOL) for k in wa
    )
    # It resumed a checkpoint saved without it; its own, saved on two ranks, resumes without it on
    # one rank, to the 1-rank run's end.
    out = run(tmp_path, "again", *SIX, "--resume", str(offload / "checkpoints" / "step-5"))
    wc = load_safetensors(os.path.join(out, "final"))
    assert all(
        torch.allclose(wc[k], v, rtol=0, atol=ADAM_ATOL)
        for k, v in load_safetensors(os.path.join(six_steps[0], "final")).items()
    )


def test_two_ranks_tokenize_once_on_rank_0_and_share_the_cache(two_ranks, tmp_path, monkeypatch):
    two = two_ranks[0]["resumed"]
    cache, calls = two.parent / "cache", [r["tokenize_calls"] for r in run_records(two, 2)]
    assert calls == [
        2,
        0,
    ]  # rank 0 tokenized train and eval; rank 1 read its cache (and trained like one rank)
    assert len([f for f in os.listdir(cache) if f.startswith("tokens-")]) == 1
    real, again = data.tokenize_rows, []

    def tokenize_rows(*args, **kwargs):
        again.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(data, "tokenize_rows", tokenize_rows)
    run(tmp_path, "again", "--max-steps", "1", "--cache-dir", str(cache))
    assert again == []  # a later run finds the cache and tokenizes nothing


def test_two_ranks_match_one_then_a_preempted_step_is_saved_once_and_resumes_on_one_rank(
    six_steps, two_ranks
):
    # two_ranks's "preempted": two ranks of 8 pairs each (no accumulation), while rank 0 takes 8 s
    # to load the model and collectives time out after 6 s: rank 1 must wait for it on the store
    # (fsdp_setup.on_rank0), not in a collective.
    out = two_ranks[0]["preempted"]
    err = run_lines(two_ranks[1], out)
    # Both ranks stop as SIGTERM's (rank 0 without the signal), after saving step 3.
    records = [(r["error"], r["exit"]) for r in run_records(out, 2)]
    assert records == [(None, 128 + signal.SIGTERM)] * 2, err[-3000:]
    assert "stopped by a signal after step 3" in err
    assert (out / "checkpoints" / "latest").read_text() == "step-3" and not (out / "final").exists()
    assert json.load(open(out / "checkpoints" / "step-3" / "trainer_state.json"))["world_size"] == 2
    assert [r["step"] for r in read_metrics(str(out))] == [1, 2, 3]
    run(out.parent, out.name, *SIX, "--resume", "latest")  # DCP reshards 2 ranks -> 1
    # Steps 1-3 on two ranks, 4-6 on one: the uninterrupted 1-rank run's metrics, tensor names and
    # weights.
    _assert_same_run(six_steps[0], str(out), exact=False)


def test_one_rank_checkpoint_resumes_on_two_ranks_accumulating_micro_batches(six_steps, two_ranks):
    full, two = six_steps[0], two_ranks[0]["resumed"]
    # This run's lines: the first of the start.
    err = two_ranks[1].split(f"saved {two / 'final'}")[0]
    assert "resumed from" in err and "at step 4 (saved on 1 ranks" in err
    # Rank 0 alone resolves --resume latest, for both.
    assert [r["resolves"] for r in run_records(two, 2)] == [1, 0]
    _assert_same_rows(read_metrics(full)[4:], read_metrics(str(two)))
    wa, wb = load_safetensors(os.path.join(full, "final")), load_safetensors(str(two / "final"))
    assert set(wa) == set(wb) == _hf_export_names()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=ADAM_ATOL)


KILL_MID_SAVE = """
import os, signal, sys
from torch.distributed.checkpoint import FileSystemWriter
import train_dpo
real = FileSystemWriter.write_data

# step 4's shards reach the disk, then the process dies mid-save
def write_data(self, plan, planner):
    written = real(self, plan, planner)
    if "step-4" in str(self.path):
        os.kill(os.getpid(), signal.SIGKILL)
    return written

FileSystemWriter.write_data = write_data
train_dpo.main(sys.argv[1:])
"""


def test_background_saves_work_in_one_process_group_after_another(tmp_path):
    import checkpoint

    for i in range(2):  # the write's own gloo group belongs to the process group it was made in
        with world_of_one():
            model, _, _ = sharded_tiny(seed=0)
            optimizer = torch.optim.AdamW(model.parameters())
            saver = checkpoint.Checkpointer(str(tmp_path / str(i)), background=True)
            saver.save(1, model, optimizer, {"step": 1})
            saver.finish()
        assert (tmp_path / str(i) / "latest").read_text() == "step-1"
        assert checkpoint.read_trainer_state(str(tmp_path / str(i) / "step-1")) == {
            "step": 1,
            "world_size": 1,
        }


def test_background_saves_reuse_the_staging_buffers_and_each_holds_its_own_step(
    tmp_path, monkeypatch
):
    """The GPU path's one stager (its pinning aside: no CUDA here): the second save copies into the
    first one's host buffers, and neither checkpoint holds the other's weights."""
    import checkpoint
    from torch.distributed.checkpoint import staging

    options = staging.StagingOptions(
        use_pinned_memory=False,
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=False,
    )
    stager = staging.DefaultStager(options)
    expected = []
    with world_of_one():
        saver = checkpoint.Checkpointer(str(tmp_path), background=True)
        saver._stager = stager
        model, _, _ = sharded_tiny(seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        for step in (1, 2):
            model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            # On CPU, full_state's tensors are views of the weights: cloned.
            expected.append({k: v.clone() for k, v in full_state(model).items()})
            saver.save(step, model, optimizer, {"step": step})
            if step == 1:
                staged = {id(s) for s in stager._state_dict_stager._cached_storage_mapping.values()}
        saver.finish()
        assert {id(s) for s in stager._state_dict_stager._cached_storage_mapping.values()} == staged
        for step in (1, 2):
            fresh, _, _ = sharded_tiny(seed=1)
            checkpoint.load_checkpoint(
                str(tmp_path / f"step-{step}"), fresh, torch.optim.AdamW(fresh.parameters())
            )
            loaded = full_state(fresh)
            assert all(torch.equal(loaded[k], v) for k, v in expected[step - 1].items()), step


def test_a_run_refuses_an_out_dir_it_cannot_make_and_makes_nothing_to_check_it(tmp_path):
    """The nearest folder above the run's checkpoints that exists must be a folder: an --out-dir
    that is a file, or lies under one, is refused naming both; a new nested one is made by no
    check (nothing is half-written by a run that fails later)."""
    (tmp_path / "file").write_text("not a folder")
    for out in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(ValueError) as info:
            checkpoint.resume_state(str(out / "checkpoints"), None, {}, {})
        assert str(info.value) == f"{out}: a run cannot make its folder in {tmp_path / 'file'}"
    new = tmp_path / "new" / "deeper"
    assert checkpoint.resume_state(str(new / "checkpoints"), None, {}, {}) is None
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------------------------- metrics.py
# FLOPs and MFU, ranking metrics, and W&B.


@pytest.mark.parametrize(
    "loss, online, lora_rank",
    [("dpo", True, 0), ("dpo", False, 0), ("sft", False, 0), ("dpo", True, 4)],
)
def test_logged_flops_match_pytorch_flop_counter(loss, online, lora_rank):
    from torch.utils.flop_counter import FlopCounterMode

    config, tok = tiny_config()
    config._attn_implementation = (
        "eager"  # attention as matmuls, which the counter sees (CPU SDPA it does not)
    )
    objective = LossConfig(loss=loss)
    cfg = train_dpo.Config(objective=objective, lora=LoraConfig(lora_rank=lora_rank))
    policy = train_dpo.prepare_model(cfg, tiny_model(config, 0))
    # LoRA: the reference is the policy with its adapters off, and the backward makes no base weight
    # gradient
    reference = None
    if online and lora_rank:
        reference = WithoutAdapters(policy)
    elif online:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    # SFT alone lays out each row's best response only (the trainer's layout for it).
    batch = collate_pairs(
        tokenize(demo_pairs("train")[:4], tok, 128, 64), tok.pad_token_id, best_only=loss == "sft"
    )
    ref_logps = (
        None if online or loss == "sft" else torch.zeros(len(batch.response_lengths))
    )  # --ref precompute
    with FlopCounterMode(display=False) as counter:
        out = forward_pairs(policy, reference, batch, objective, ref_logps, tokens_per_pair=10.0)
        out.losses.sum().backward()
    counts = metrics.batch_counts(
        metrics.flop_coefficients(policy),
        2 if lora_rank else 3,
        reference is not None,
        batch,
    )
    ours = counts[2].item()
    # Equal on the CPU path (on a GPU the counter would also see the fused head recompute its
    # logits in backward, which model FLOPs leave out). LoRA's model FLOPs count a backward of one
    # forward's worth, where autograd also computes the adapters' weight gradients and attention's
    # second input gradient, and skips the first block's input gradients: within 1%.
    if lora_rank:
        assert ours == pytest.approx(counter.get_total_flops(), rel=1e-2)
    else:
        assert ours == counter.get_total_flops()


def test_mfu_uses_the_device_peak_for_the_precision():
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert device_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert device_peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert device_peak_flops("Some Future GPU", "bf16") is None  # no guess: no mfu key


FAILING_WANDB = """
def init(**kwargs):
    raise RuntimeError("no API key")
"""


def test_a_failing_wandb_init_on_rank_0_stops_every_rank_at_once(two_ranks):
    # Not rank 1 waiting in the first training collective for a rank 0 that is gone.
    records = run_records(two_ranks[0]["wandb"], 2)
    assert [r["error"] for r in records] == ["no API key", "rank 0 failed: no API key"]
    assert not read_metrics(two_ranks[0]["wandb"])  # no step was trained


def test_wandb_gets_the_same_rows_and_a_clear_error_when_missing(tmp_path, monkeypatch, capsys):
    import importlib.machinery
    import types

    calls = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    def table(columns, data):
        return ("table", columns, data)

    def init(**kw):
        calls.append(("init", kw))
        return types.SimpleNamespace(
            log=lambda data, step: calls.append(("log", step, data)),
            finish=lambda: calls.append(("finish",)),
        )

    fake.Table, fake.init = table, init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = run(
        tmp_path,
        "run",
        "--max-steps",
        "2",
        "--num-samples",
        "2",
        "--sample-max-tokens",
        "4",
        "--wandb-project",
        "p",
        "--wandb-run-name",
        "first",
        "--eval-before",
        "--save-every",
        "2",
    )
    assert calls[0][0] == "init" and calls[0][1]["project"] == "p" and calls[-1] == ("finish",)
    assert calls[0][1]["name"] == "first" and calls[0][1]["resume"] == "allow"
    logged = [c for c in calls if c[0] == "log"]
    train = [(step, data["train/loss"]) for _, step, data in logged if "train/loss" in data]
    assert train == [(r["step"], r["loss"]) for r in read_metrics(out)]
    evals = [(step, data) for _, step, data in logged if "eval/loss" in data]
    assert [s for s, _ in evals] == [0, 2] and evals[0][1]["samples"][1] == [
        "step",
        "prompt",
        "completion",
    ]
    # Resumed, in the same --out-dir: the same W&B run goes on; a fresh run in another gets its own.
    first = calls[0][1]["id"]
    calls.clear()
    run(tmp_path, "run", "--max-steps", "3", "--wandb-project", "p", "--resume", "latest")
    assert calls[0][1]["id"] == first and {c[1] for c in calls if c[0] == "log"} == {3}
    calls.clear()
    run(tmp_path, "other", "--max-steps", "1", "--wandb-project", "p")
    assert calls[0][1]["id"] != first
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run(tmp_path, "missing", "--wandb-project", "p")
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr().err.strip()
        == "error: --wandb-project needs the wandb package: pip install wandb"
    )
    assert not (tmp_path / "missing").exists()


def _naive_metrics(rewards, scores):
    """(top1, Kendall's tau-b) of one row's valid entries, by loops."""
    n = len(rewards)
    if n == 0:
        return 0.0, 0.0
    best = [i for i in range(n) if scores[i] == max(scores)]
    others = [rewards[i] for i in range(n) if i not in best]
    top1 = float(max(rewards[i] for i in best) > max(others, default=-math.inf))
    concordant = discordant = tied_scores = tied_rewards = 0
    for i in range(n):
        for j in range(i + 1, n):
            product = (scores[i] - scores[j]) * (rewards[i] - rewards[j])
            concordant += product > 0
            discordant += product < 0
            tied_scores += scores[i] == scores[j]
            tied_rewards += rewards[i] == rewards[j]
    pairs = n * (n - 1) / 2
    denominator = math.sqrt((pairs - tied_scores) * (pairs - tied_rewards))
    return top1, (concordant - discordant) / denominator if denominator else 0.0


def test_naive_kendall_is_tau_b():
    # scipy.stats.kendalltau's documented example (tau-b, ties in both); and no ties: 1/3.
    assert _naive_metrics([1, 4, 7, 1, 0], [12, 2, 1, 12, 2])[1] == pytest.approx(
        -0.47140452079103173
    )
    assert _naive_metrics([1, 3, 2], [1, 2, 3])[1] == pytest.approx(1 / 3)


def test_ranking_metrics_match_a_naive_loop():
    """metrics' best_on_top and Kendall's tau-b of a batches.RowBatch's rows (K from 2 to 6, ties
    in scores and in rewards) against loops over each row."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(200):
        k = int(torch.randint(2, 7, (), generator=g))
        scores = torch.randint(0, 4, (k,), generator=g).float().tolist()
        rows.append({"prompt": [1], "responses": [[2]] * k, "scores": scores})
    batch = collate_rows(rows, pad_id=0)
    logratios = torch.randint(-2, 3, batch.response_rows.shape, generator=g).float() * 0.25
    top1, kendall = metrics._ranking(logratios, batch)
    expected = [
        _naive_metrics(logratios[batch.response_rows == b].tolist(), row["scores"])
        for b, row in enumerate(rows)
    ]
    assert top1.tolist() == [t for t, _ in expected]
    torch.testing.assert_close(kendall, torch.tensor([tau for _, tau in expected]))


# ---------------------------------------------------------------------------------------- models.py
# Loading weights (converted checkpoints too), exports, and the shared-prompt probe.


def test_weight_files_at_unaligned_offsets_read_right(tmp_path):
    """Other writers need not align a tensor to its item size; a typed view needs it, so such a
    tensor is copied."""
    tensors = {
        "a": torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16),
        "b": torch.tensor([7, -9], dtype=torch.int64),
    }
    header = {
        "a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
        "b": {"dtype": "I64", "shape": [2], "data_offsets": [6, 22]},
    }  # b at byte 6: not a multiple of 8
    text = json.dumps(header).encode() + b" " * (-len(json.dumps(header)) % 8)
    data = b"".join(t.view(torch.uint8).numpy().tobytes() for t in tensors.values())
    (tmp_path / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + data)
    read = open_weights(str(tmp_path), tiny_config()[0], 0)
    assert all(torch.equal(read[k], v) and read[k].dtype == v.dtype for k, v in tensors.items())


def test_weights_load_from_several_bf16_files_and_export_in_several_files_tensor_by_tensor(
    tmp_path, monkeypatch
):
    """A folder's files, read a slice at a time (models.open_weights), against Hugging Face's own
    from_pretrained; the export, written one tensor at a time in several files, against its
    from_pretrained and the weights."""
    config, tok = tiny_config()
    config.tie_word_embeddings = False  # an untied output layer too
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(
        tmp_path / "in", max_shard_size="300KB"
    )
    assert len([f for f in os.listdir(tmp_path / "in") if f.endswith(".safetensors")]) > 2
    batch = collate_pairs(tokenize(demo_pairs("train")[:3], tok, 64, 32), tok.pad_token_id)
    expected = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "in", dtype=torch.float32
    )
    monkeypatch.setattr(models, "_FILE_BYTES", 400_000)
    with world_of_one():
        mp_policy = resolve_precision(PrecisionConfig("fp32"), CPU).mp_policy
        model = fsdp_setup.build_sharded(
            functools.partial(build_model, config),
            open_weights(str(tmp_path / "in"), config, 0),
            mp_policy,
            CPU,
            FSDPConfig(),
        )
        with torch.no_grad():
            torch.testing.assert_close(
                model(input_ids=batch.input_ids).logits,
                expected(input_ids=batch.input_ids).logits,
                rtol=0,
                atol=0,
            )
        models.save_pretrained(
            str(tmp_path / "out"), model, full_tensors(model, CPU), torch.bfloat16
        )
    files = sorted(f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["architectures"] == [
            "LlamaForCausalLM"
        ]  # what serving engines build from
    names = expected.state_dict().keys()
    assert exported.dtype == torch.bfloat16 and exported.state_dict().keys() == names
    for (
        name,
        tensor,
    ) in exported.state_dict().items():  # bf16 files, loaded into float32, written as bf16
        assert torch.equal(tensor, expected.state_dict()[name].bfloat16()), name
    monkeypatch.setattr(
        models, "_FILE_BYTES", 2**40
    )  # exported again into the same folder, as one file
    with world_of_one():
        model = fsdp_setup.build_sharded(
            functools.partial(build_model, config),
            open_weights(str(tmp_path / "out"), config, 0),
            mp_policy,
            CPU,
            FSDPConfig(),
        )
        models.save_pretrained(
            str(tmp_path / "out"), model, full_tensors(model, CPU), torch.bfloat16
        )
    assert sorted(f for f in os.listdir(tmp_path / "out") if f.startswith("model")) == [
        "model.safetensors"
    ]
    assert (
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict().keys()
        == names
    )


def test_a_folder_without_the_weights_the_model_needs_fails_with_one_line(tmp_path):
    config, _ = tiny_config()
    with pytest.raises(ValueError, match="no model.safetensors nor model.safetensors.index.json"):
        models.find_weights(str(tmp_path))
    full = tiny_model(config, 0)
    dropped = (
        "lm_head.weight",
        "model.layers.3.mlp.up_proj.weight",
    )  # tied (not saved); the one missing
    safetensors.torch.save_file(
        {k: v for k, v in full.state_dict().items() if k not in dropped},
        str(tmp_path / "model.safetensors"),
    )
    with (
        world_of_one(),
        pytest.raises(
            ValueError,
            match=r"^--model: its weight model.layers.3.mlp.up_proj.weight "
            r"of shape \[384, 128\] is missing in its files$",
        ),
    ):
        fsdp_setup.build_sharded(
            functools.partial(build_model, config),
            open_weights(str(tmp_path), config, 0),
            MixedPrecisionPolicy(),
            CPU,
            FSDPConfig(),
        )


# Architectures whose files transformers converts while loading, as their own save_pretrained writes
# them: GPT-NeoX names its output layer embed_out; Qwen3-MoE keeps one tensor per expert and
# projection, fused into (experts, 2 x intermediate, hidden) on load; Mixtral does both (renames
# block_sparse_moe, fuses w1 and w3).
CONVERTED = ("gpt_neox", "qwen3_moe", "mixtral")


def _file_tensors(folder):
    return load_safetensors_file(os.path.join(folder, "model.safetensors"))


@pytest.mark.parametrize("kind", CONVERTED)
def test_converted_checkpoints_load_as_transformers_loads_them_and_export_as_it_saves(
    kind, tmp_path
):
    """The trainer's sharded load against from_pretrained's logits, bit for bit; its export against
    the files save_pretrained wrote: the same names, layout and values."""
    folder = converted_model(kind)
    config = load_model_config(folder)
    expected = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with world_of_one():
        model = fsdp_setup.build_sharded(
            functools.partial(build_model, config),
            open_weights(folder, config, 0),
            MixedPrecisionPolicy(),
            CPU,
            FSDPConfig(),
        )
        with torch.no_grad():
            torch.testing.assert_close(
                model(input_ids=ids).logits, expected(input_ids=ids).logits, rtol=0, atol=0
            )
        models.save_pretrained(str(tmp_path), model, full_tensors(model, CPU), torch.float32)
    written, saved = _file_tensors(tmp_path), _file_tensors(folder)
    assert written.keys() == saved.keys()
    assert all(torch.equal(written[k], saved[k]) for k in saved)


def test_a_rank_reads_only_the_experts_of_its_own_rows():
    """A stacked expert weight's rows 0 and 1 are made from experts 0 and 1 alone: the other
    experts' tensors are on the meta device, which holds no data to read."""
    folder = converted_model("qwen3_moe")
    config = load_model_config(folder)
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    expected = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    weight = open_weights(folder, config, 0)[fused]
    assert weight.shape == expected.get_parameter(fused).shape == (4, 128, 64)
    for tensors in weight.sources.values():
        tensors[2:] = [t.to("meta") for t in tensors[2:]]
    assert torch.equal(weight[0:2], expected.get_parameter(fused)[0:2])
    with pytest.raises(NotImplementedError):
        weight[1:3]


def converted_args(kind):
    return ("--model", converted_model(kind), "--max-steps", "2", "--lr", "1e-3")


@pytest.fixture(scope="module")
def converted_runs(tmp_path_factory):
    """1-rank runs of 2 steps on each of CONVERTED, and a LoRA run on GPT-NeoX exporting the merged
    model: {name: out_dir}."""
    folder = tmp_path_factory.mktemp("converted")
    outs = {kind: run(folder, kind, *converted_args(kind)) for kind in CONVERTED}
    lora_args = (*converted_args("gpt_neox"), *LORA, "--export-merged")
    outs["lora"] = run(folder, "lora", *lora_args)
    return outs


@pytest.mark.parametrize("kind", [*CONVERTED, "lora"])
def test_converted_checkpoints_train_from_ln2_and_export_loadably(kind, converted_runs):
    """From loss ln 2; the export has save_pretrained's names, loads in transformers and scores the
    held-out set as the run's last evaluation did. (Two ranks as one: in two_ranks's tests.)"""
    one = converted_runs[kind]
    folder = converted_model("gpt_neox" if kind == "lora" else kind)
    assert read_metrics(one)[0]["loss"] == pytest.approx(math.log(2), abs=F32_REL)
    final = os.path.join(one, "final")
    assert _file_tensors(final).keys() == _file_tensors(folder).keys()
    model = add_scored_head(transformers.AutoModelForCausalLM.from_pretrained(final))
    reference = add_scored_head(transformers.AutoModelForCausalLM.from_pretrained(folder))
    tok = transformers.AutoTokenizer.from_pretrained(final)
    pairs = tokenize(HELD_OUT_PAIRS, tok, 512, 256)
    with torch.no_grad():
        out = forward_pairs(
            model.eval(), reference.eval(), collate_pairs(pairs, tok.pad_token_id), LossConfig()
        )
    last = read_metrics(one, "eval")[-1]
    # The export scored outside the trainer: another summation order of the same log-probs.
    assert out.losses.mean().item() == pytest.approx(
        last["loss"], **_rounding_bound("loss", last, beta=0.1)
    )
    assert last["loss"] < math.log(2) - 1e-3


def test_attention_that_takes_no_dense_mask_scores_separate_rows():
    """Flash attention takes no dense mask: refused without a probe, so the trainer keeps separate
    rows."""
    config = _shared_config("llama")
    config._attn_implementation = "flash_attention_2"
    assert models.shared_prompt_refusal(config, logps.shared_row_inputs)


@pytest.mark.parametrize("kind", CONVERTED)
def test_converted_checkpoints_train_on_two_ranks_as_on_one(kind, converted_runs, two_ranks):
    """Each rank reads its own rows of the converted files (test_a_rank_reads_only_the_experts_of_
    its_own_rows shows it exactly; these models are too small for host memory to show it)."""
    _assert_same_run(converted_runs[kind], str(two_ranks[0][kind]), exact=False)


# Models the former hand list left out, which the probe lets share: each a shared row matched
# separate rows to 3e-7 in float32 (transformers 5.23).
NEW = (
    "phi3",
    "olmo2",
    "granite",
    "cohere",
    "stablelm",
    "starcoder2",
    "gemma3_text",
    "smollm3",
    "qwen2_moe",
    "opt",
    "falcon",
    "gptj",
)
# Models transformers 5.23 builds in eager attention only; Gemma 2, whose soft-capping needs it.
EAGER = {"gemma2", "gptj", "bloom"}


def _tiny_config(kind):
    """_shared_config's `kind`, in the attention the trainer builds it with."""
    config = _shared_config(kind)
    config._attn_implementation = "eager" if kind in EAGER else "sdpa"
    return config


def _real_config(kind):
    """`kind`'s default (full-size) config, as a built model's: its attention set. Starcoder2's
    checkpoints set the sliding window its default leaves out."""
    config = transformers.AutoConfig.for_model(kind)
    if kind == "starcoder2":
        config.sliding_window = 4096
    config._attn_implementation = "eager" if kind in EAGER else "sdpa"
    return config


def _tiny_model(kind):
    torch.manual_seed(0)
    return add_scored_head(transformers.AutoModelForCausalLM.from_config(_tiny_config(kind)).eval())


def _logps_both_layouts(model, pairs):
    """(2B,) response_logps of `pairs` in shared rows, then in separate rows, as training lays
    them out (batches.collate_pairs)."""
    with torch.no_grad():
        return [
            response_logps(model, collate_pairs(pairs, pad_id=0, share_prompt=share))
            for share in (True, False)
        ]


@pytest.fixture
def fresh_probes(monkeypatch):
    """An empty verdict cache: each probe below runs."""
    monkeypatch.setattr(models, "_PROBED", {})


@pytest.mark.parametrize("kind", NEW)
def test_listed_and_new_models_share_and_a_shared_row_matches_separate_rows(kind, fresh_probes):
    """Independently of the probe, on a tiny random model of each (windows of 8, rows up to 33
    tokens): shared rows' log-probs equal separate rows' within 1e-5 under its own mask kind.
    Then the probe, on the model type's full-size config (never built), says it shares, in a few
    seconds, and once per process."""
    model = _tiny_model(kind)
    shared, separate = _logps_both_layouts(model, _random_pairs(SHARED_LENGTHS))
    torch.testing.assert_close(shared, separate, rtol=LOGP_REL, atol=LOGP_REL)
    config = _real_config(kind)
    # CPU time, which other processes on a shared machine do not stretch as they do wall time.
    start = time.process_time()
    assert models.shared_prompt_refusal(config, logps.shared_row_inputs) == ""
    seconds = time.process_time() - start
    assert seconds < 10, f"{kind}: the probe took {seconds:.1f} s of CPU time"
    assert (
        not models.shared_prompt_refusal(config, logps.shared_row_inputs)
        and len(models._PROBED) == 1
    )
    # The built model's own config (its attention set by from_config) shares too.
    assert (
        not models.shared_prompt_refusal(model.config, logps.shared_row_inputs)
        and len(models._PROBED) == 2
    )


def test_the_window_and_the_response_mask_each_matter_in_that_check():
    """The check above can fail: Starcoder2's shared rows without its sliding window, or with the
    rejected tokens seeing the chosen ones, score differently from separate rows."""
    model = _tiny_model("starcoder2")
    pairs = _random_pairs(SHARED_LENGTHS)
    separate = response_logps(model, collate_pairs(pairs, pad_id=0))
    shared = collate_pairs(pairs, pad_id=0, share_prompt=True)
    # Each change moves the log-probs by far more than rounding: 100 times the check's bound.
    model.config.sliding_window = None
    assert not torch.allclose(response_logps(model, shared), separate, atol=100 * LOGP_REL)
    model.config.sliding_window = 8
    torch.testing.assert_close(
        response_logps(model, shared), separate, rtol=LOGP_REL, atol=LOGP_REL
    )
    shared.segment_ids[shared.segment_ids == 2] = 1
    assert not torch.allclose(response_logps(model, shared), separate, atol=100 * LOGP_REL)


def test_bloom_does_not_share_and_the_probe_says_why(fresh_probes):
    """BLOOM's ALiBi is built from a 2D mask and refuses the 4D one: the probe answers False and
    keeps the error as its reason, the error shared rows really raise."""
    for config in (_real_config("bloom"), _tiny_config("bloom")):
        assert models.shared_prompt_refusal(config, logps.shared_row_inputs)
        why = models.shared_prompt_refusal(config, logps.shared_row_inputs)
        assert why.startswith("its probe raised ValueError: "), why
    model = _tiny_model("bloom")
    with pytest.raises(ValueError, match=re.escape(why.split("ValueError: ")[1])):
        _logps_both_layouts(model, _random_pairs(SHARED_LENGTHS))


# The probe compares one forward's log-probs. AdamW runs in the two layouts can still part later:
# Adam's first update lr g / (|g| + eps) turns rounding-size gradient differences at elements with
# |g| near eps into weights some 1e-2 lr apart, and a ReLU (OPT's) turns that into a jump in the
# next gradient. Separate rows with the pairs in another order do the same: it is not the layout.
# (prompt, chosen, rejected) lengths of 16 pairs: a batch (one of 80 random ones tried, 3 of which
# do it) where OPT's AdamW runs in shared and in separate rows part at step 2 (3e-4 in the gradient
# norm, float32, x86 CPU), as they do with separate rows alone and the pairs in another order.
OPT_ADAM_LENGTHS = [
    *((1, 16, 4), (13, 5, 22), (2, 5, 4), (18, 8, 23), (5, 5, 24), (2, 22, 2), (5, 8, 18)),
    *((24, 15, 17), (14, 7, 19), (3, 4, 1), (13, 11, 7), (7, 11, 13), (12, 20, 8), (7, 24, 7)),
    *((14, 19, 22), (18, 2, 2)),
]


def test_opt_takes_the_same_steps_shared_or_separate_but_for_adams_first_step():
    """OPT, float32, on a batch where AdamW's 2-step runs in shared and separate rows part: the two
    layouts give the same step-1 gradients to float32 rounding, and from the same weights the same
    step-2 gradients; with SGD their runs agree within 1e-5. AdamW's first step moves a weight by
    lr * g / (|g| + eps), whose slope in g is up to 1/eps: a gradient near eps (1e-8, 1e-7 of the
    largest) turns a rounding-size difference into weights some 1e-5 apart (1e7 times what SGD's
    lr * g does), and OPT's ReLU, the one of _shared_config's models, flips where a pre-activation
    lies that close to 0: a jump in step 2's gradient, of the weights, not of the layout."""
    objective = LossConfig(loss=("dpo",), ref="online")
    pairs = [_random_pairs(OPT_ADAM_LENGTHS, seed=step) for step in range(2)]
    torch.manual_seed(0)
    start = add_scored_head(
        transformers.AutoModelForCausalLM.from_config(_shared_config("opt"))
    ).eval()
    reference = copy.deepcopy(start).requires_grad_(False)
    eps32 = F32_EPS

    def step(policy, n, share):
        """Step n's mean loss and gradients (and their norm), in shared or separate rows."""
        policy.zero_grad()
        batch = collate_pairs(pairs[n], pad_id=0, share_prompt=share)
        logps, ref, _ = side_logps(policy, reference, batch, objective)
        loss_ = pair_losses(objective, logps, ref, batch.response_lengths).losses.mean()
        loss_.backward()
        grads = [p.grad.clone() for p in policy.parameters()]
        norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()
        return loss_.item(), norm, grads

    def assert_same_gradients(a, b):
        # Each element a sum of terms up to the largest gradient's size: rounding is some eps32 of
        # that, never LOGP_REL (84 eps32) of it.
        largest = max(g.abs().max() for g in b)
        for x, y in zip(a, b):
            assert (x - y).abs().max() <= LOGP_REL * largest

    lr, eps = 1e-3, 1e-8
    after, grads = {}, {}
    for share in (True, False):
        after[share] = copy.deepcopy(start)
        *_, grads[share] = step(after[share], 0, share)
        torch.optim.AdamW(after[share].parameters(), lr=lr, eps=eps).step()
    assert_same_gradients(grads[True], grads[False])
    # AdamW's first step: w - lr * (0.01 w + g / (|g| + eps)), its slope in g at most 1/eps; the
    # float32 rounding of the update on top.
    moved = []
    for w, v, start_w, a, b in zip(
        after[True].parameters(), after[False].parameters(), start.parameters(), *grads.values()
    ):
        gap = (w - v).abs()
        assert (gap <= lr * (a - b).abs() / eps + 2 * eps32 * (start_w.abs() + lr)).all()
        moved.append((gap.max() / (lr * (a - b).abs().max().clamp(min=eps32 * 1e-3))).item())
    # ... which sets some weights apart 1000 times and more than SGD's would (lr * |g_a - g_b|).
    assert max(moved) > 1e3
    # Step 2 from the same weights, either run's: the layouts agree.
    for policy in after.values():
        loss_a, norm_a, grads_a = step(policy, 1, True)
        loss_b, norm_b, grads_b = step(policy, 1, False)
        assert loss_a == pytest.approx(loss_b, rel=LOGP_REL)
        assert norm_a == pytest.approx(norm_b, rel=LOGP_REL)
        assert_same_gradients(grads_a, grads_b)
    # SGD, whose step is linear in the gradients: 2 steps alike in either layout.
    runs = []
    for share in (True, False):
        policy = copy.deepcopy(start)
        optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        history = []
        for n in range(2):
            loss_, _, _ = step(policy, n, share)
            history += [loss_, torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0).item()]
            optimizer.step()
        runs.append(history)
    assert runs[0] == pytest.approx(runs[1], rel=LOGP_REL)


def test_a_deliberately_broken_shared_scoring_makes_the_probe_refuse(monkeypatch, fresh_probes):
    """Negative controls: with the rejected tokens seeing the chosen ones, without Mistral's
    sliding window, with packed rows seeing each other, or without positions restarting after the
    prompt, the probe says False and how far apart the rows scored; the correct mask shares
    again."""
    mask = logps._mask
    row_inputs = logps.shared_row_inputs

    def peeking(config, segments, positions, documents, window):
        return mask(config, segments.masked_fill(segments == 2, 1), positions, documents, window)

    def windowless(config, segments, positions, documents, window):
        return mask(config, segments, positions, documents, None)

    def one_document(config, segments, positions, documents, window):
        return mask(config, segments, positions, None, window)

    def running_positions(config, position_ids, segment_ids, document_ids=None):
        given = row_inputs(config, position_ids, segment_ids, document_ids)
        return {
            **given,
            "position_ids": torch.arange(position_ids.shape[1]).expand_as(position_ids),
        }

    llama, mistral = _real_config("llama"), _real_config("mistral")
    for name, broken, config in (
        ("_mask", peeking, llama),
        ("_mask", windowless, mistral),
        ("_mask", one_document, llama),
        ("shared_row_inputs", running_positions, llama),
    ):
        monkeypatch.setattr(logps, name, broken)
        monkeypatch.setattr(models, "_PROBED", {})
        assert models.shared_prompt_refusal(config, logps.shared_row_inputs), broken.__name__
        assert "shared or packed rows scored" in models.shared_prompt_refusal(
            config, logps.shared_row_inputs
        )
        monkeypatch.undo()
    monkeypatch.setattr(models, "_PROBED", {})
    assert not models.shared_prompt_refusal(
        llama, logps.shared_row_inputs
    ) and not models.shared_prompt_refusal(mistral, logps.shared_row_inputs)


def test_the_probe_keeps_the_callers_random_state_and_no_mask_attention_never_shares(
    fresh_probes,
):
    """The probe draws from its own seed and runs on one thread: the caller's generator is where it
    was, and its thread count is back. Flash attention takes no dense mask, and a config holding
    other models' configs (Gemma 3's vision and text) is not probed: neither shares, each with its
    reason."""
    before, threads = torch.random.get_rng_state(), torch.get_num_threads()
    assert not models.shared_prompt_refusal(_real_config("qwen2"), logps.shared_row_inputs)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.get_num_threads() == threads  # the probe's one thread given back
    config = _real_config("llama")
    config._attn_implementation = "flash_attention_2"
    assert (
        models.shared_prompt_refusal(config, logps.shared_row_inputs)
        == "flash_attention_2 attention takes no dense mask"
    )
    config = transformers.AutoConfig.for_model("gemma3")
    config._attn_implementation = "sdpa"
    assert models.shared_prompt_refusal(config, logps.shared_row_inputs)
    assert "holds other models' configs" in models.shared_prompt_refusal(
        config, logps.shared_row_inputs
    )
    assert len(models._PROBED) == 1


# ------------------------------------------------------------------------------------------ lora.py
# Adapters: the reference as the base, adapter checkpoints, merged exports and flags.


def sharded_lora(seed, precision="fp32", rank=4):
    """The trainer's LoRA path: adapters on the meta-device model, sharded, filled with the base's
    weights."""
    config, tok = tiny_config()
    cfg = train_dpo.Config(lora=LoraConfig(lora_rank=rank), seed=seed)

    def make():
        return train_dpo.prepare_model(cfg, build_model(config))

    weights = initial_weights(make(), open_weights("tiny", config, seed))
    mp_policy = resolve_precision(PrecisionConfig(precision), CPU).mp_policy
    return fsdp_setup.build_sharded(make, weights, mp_policy, CPU, cfg.fsdp), tok


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lora_reference_is_the_base_model_exactly_and_only_the_adapters_train(precision):
    with world_of_one():
        policy, tok = sharded_lora(3, precision)
        dtypes = {(p.dtype, p.requires_grad) for p in policy.parameters()}
        compute = resolve_precision(PrecisionConfig(precision), CPU).compute_dtype
        assert dtypes == {
            (compute, False),
            (torch.float32, True),
        }  # frozen base in the compute dtype; fp32 adapters
        # The reference to match: fp32, the plain Hugging Face model; bf16, full fine-tuning's
        # frozen reference.
        base = tiny(3)[0] if precision == "fp32" else sharded_tiny(3, precision, frozen=True)[0]
        batch = collate_pairs(tokenize(demo_pairs("train")[:4], tok, 128, 64), tok.pad_token_id)
        with torch.no_grad():
            expected = response_logps(base, batch)
            torch.testing.assert_close(
                response_logps(WithoutAdapters(policy), batch), expected, rtol=0, atol=0
            )
        before = {
            k: v.clone() for k, v in full_state(policy).items()
        }  # on CPU: views of the weights
        optimizer = torch.optim.AdamW(
            [p for p in policy.parameters() if p.requires_grad], lr=1e-2, weight_decay=0
        )
        for step in range(2):
            out = forward_pairs(policy, WithoutAdapters(policy), batch, LossConfig())
            if (
                step == 0
            ):  # B starts at 0: the policy is its own reference, every pair's loss is ln 2
                torch.testing.assert_close(
                    out.losses, torch.full((4,), math.log(2)), rtol=0, atol=F32_REL
                )
            out.losses.mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        after = full_state(policy)
        moved = {k for k in before if not torch.equal(before[k], after[k])}
        assert moved == {
            k for k in before if ".lora_" in k
        }  # every A and B moved; every base weight is as it was
        modes = []  # the reference runs in eval mode (no dropout), whatever the policy's mode
        policy.base_model.model.model.layers[0].register_forward_pre_hook(
            lambda m, a: modes.append(m.training)
        )
        with torch.no_grad():
            torch.testing.assert_close(
                response_logps(WithoutAdapters(policy.train()), batch), expected, rtol=0, atol=0
            )
        assert modes == [False] and policy.training


@pytest.fixture(scope="module")
def lora_six(tmp_path_factory):
    """A 1-rank LoRA run of 6 steps (SIX), checkpointed every 2."""
    return run(tmp_path_factory.mktemp("lora"), "run", *SIX, *LORA, "--save-every", "2")


def test_lora_run_starts_at_ln2_checkpoints_only_adapters_and_exports_a_peft_folder(lora_six):
    import peft
    from torch.distributed.checkpoint import FileSystemReader

    rows = read_metrics(lora_six)
    assert (
        rows[0]["loss"] == pytest.approx(math.log(2), abs=F32_REL)
        and rows[-1]["loss"] < rows[0]["loss"] - 0.05
    )
    saved = (
        FileSystemReader(os.path.join(lora_six, "checkpoints", "step-4"))
        .read_metadata()
        .state_dict_metadata
    )
    weights = [k for k in saved if k.startswith("model.")]
    assert len(weights) == 4 * 7 * 2 and all(
        ".lora_A." in k or ".lora_B." in k for k in weights
    )  # no base weight
    final = os.path.join(lora_six, "final")
    config = json.load(open(os.path.join(final, "adapter_config.json")))
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (8, 16, 0)
    linears = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert set(config["target_modules"]) == linears
    loaded = peft.PeftModel.from_pretrained(
        tiny(0)[0], final
    )  # the base is the tiny model of --seed 0
    for name, p in loaded.named_parameters():
        if ".lora_" in name:  # peft's names carry the adapter's, the file's do not
            torch.testing.assert_close(
                p, _adapters(lora_six)[name.replace(".default", "")], rtol=0, atol=0
            )
    # The tiny base, saved nowhere else, lies beside the adapters: the folder alone loads, offline,
    # and computes what the adapters on the tiny model of --seed 0 compute, bit for bit.
    assert config["base_model_name_or_path"] == os.path.abspath(final)  # from any folder
    alone = transformers.AutoModelForCausalLM.from_pretrained(final, local_files_only=True)
    x = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        torch.testing.assert_close(
            alone(input_ids=x).logits, loaded(input_ids=x).logits, rtol=0, atol=0
        )
        assert alone.generate(x, max_new_tokens=4, min_new_tokens=4).shape == (1, 37 + 4)


def test_lora_resume_is_bit_exact_and_the_merged_export_is_w_plus_scaled_ba(lora_six, tmp_path):
    import peft

    out = tmp_path / "resumed"
    shutil.copytree(os.path.join(lora_six, "checkpoints"), out / "checkpoints")
    (out / "checkpoints" / "latest").write_text("step-4")
    run(tmp_path, "resumed", *SIX, *LORA, "--resume", "latest", "--export-merged")
    # Bit for bit: steps 5 and 6, and the final evaluation.
    _assert_same_rows(read_metrics(lora_six)[-2:], read_metrics(out), exact=True)
    _assert_same_rows(
        read_metrics(lora_six, "eval")[-1:], read_metrics(out, "eval"), PAIR_METRICS, exact=True
    )
    base, adapters, merged = (
        tiny(0)[0].state_dict(),
        _adapters(lora_six),
        load_safetensors(out / "final"),
    )
    adapted = 0
    for name, w in merged.items():
        a = adapters.get(f"base_model.model.{name[: -len('.weight')]}.lora_A.weight")
        if a is None:  # not adapted: still the base model's weight, bit for bit
            torch.testing.assert_close(w, base[name], rtol=0, atol=0)
            continue
        b, adapted = (
            adapters[f"base_model.model.{name[: -len('.weight')]}.lora_B.weight"],
            adapted + 1,
        )
        torch.testing.assert_close(
            w, base[name] + (16 / 8) * b @ a, rtol=0, atol=F32_REL
        )  # W + (alpha / r) B A
    assert adapted == 4 * 7
    x = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        as_adapter = peft.PeftModel.from_pretrained(tiny(0)[0], os.path.join(lora_six, "final"))(
            input_ids=x
        ).logits
        as_merged = transformers.AutoModelForCausalLM.from_pretrained(out / "final")(
            input_ids=x
        ).logits
    # Logits of order 1 from a float32 forward whose linears round W + 2 BA otherwise: LOGP_REL.
    torch.testing.assert_close(as_merged, as_adapter, rtol=0, atol=LOGP_REL)


def _drawn_adapters(seed, targets=()):
    """The adapters lora.add_adapters draws for the tiny model built on the meta device, as the
    trainer builds it: by name, on the CPU."""
    config, _ = tiny_config()
    model = build_model(config)
    model = add_adapters(
        model, LoraConfig(lora_rank=4, lora_targets=targets), find_block_class(model), seed
    )
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def test_add_adapters_reseeds_no_global_generator_and_draws_from_its_seed(monkeypatch):
    reseeds = []
    manual_seed = torch.manual_seed

    def recorded_manual_seed(seed):
        reseeds.append(("torch.manual_seed", seed))
        return manual_seed(seed)

    def recorded_cuda_seed(seed):
        reseeds.append(("torch.cuda", seed))

    # torch.manual_seed reseeds every CUDA device's generator through torch.cuda.manual_seed_all:
    # recorded here whether or not this machine has a GPU.
    monkeypatch.setattr(torch, "manual_seed", recorded_manual_seed)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", recorded_cuda_seed)
    monkeypatch.setattr(torch.cuda, "manual_seed", recorded_cuda_seed)
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    first = _drawn_adapters(1)
    assert reseeds == []
    assert torch.equal(torch.get_rng_state(), cpu)
    assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), cuda))
    same, other = _drawn_adapters(1), _drawn_adapters(2)
    assert len(first) == 4 * 7 * 2 and first.keys() == same.keys() == other.keys()
    assert all(torch.equal(first[k], same[k]) for k in first)
    for name, a in first.items():
        if ".lora_B." in name:  # B starts at zero, whatever the seed
            assert not a.any() and not other[name].any()
        else:
            assert a.std() > 0 and not torch.equal(a, other[name]), name
    # An embedding's adapters (A zero, B drawn) come from the seed too.
    embedding = [_drawn_adapters(seed, ("embed_tokens",)) for seed in (1, 1, 2)]
    name = "base_model.model.model.embed_tokens.lora_embedding_B.default"
    assert torch.equal(embedding[0][name], embedding[1][name])
    assert not torch.equal(embedding[0][name], embedding[2][name])
    assert reseeds == [] and torch.equal(torch.get_rng_state(), cpu)


def test_lora_flags_fail_with_one_line(tmp_path, capsys, monkeypatch):
    import lora

    for args, message in (
        (["--export-merged"], "--export-merged needs --lora-rank"),
        (
            ["--lora-rank", "4", "--lora-targets", "qkv"],
            "--lora-targets qkv: Target modules {'qkv'} not found in the base model",
        ),
        (["--lora-rank", "-1"], "--lora-rank must be >= 0"),
        (
            ["--lora-rank", "4", "--lora-targets", "lm_head"],  # it computes the log-probs
            "--lora-targets: the output layer takes no adapters here",
        ),
        (
            ["--lora-rank", "4", "--lora-targets", "embed_tokens", "--export-merged"],
            "--export-merged merges adapters on linear layers only; "
            "model.embed_tokens is a Embedding",
        ),
        (["--lora-rank", "4", "--lora-dropout", "0.1"], "--lora-dropout needs --dropout"),
    ):
        with pytest.raises(SystemExit) as exit_:
            run(tmp_path, "bad", "--max-steps", "1", *args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"error: {message}" in err and "Traceback" not in err, err
    monkeypatch.setitem(sys.modules, "peft", None)  # as if peft were not installed
    with pytest.raises(SystemExit):
        run(tmp_path, "bad", "--max-steps", "1", "--lora-rank", "4")
    assert "error: --lora-rank needs the peft package: pip install peft" in capsys.readouterr().err
    with pytest.raises(ValueError, match="pip install peft"):
        lora.LoraConfig(lora_rank=4)
    assert not (tmp_path / "bad").exists()  # nothing written


# -------------------------------------------------------------------------------------- generate.py
# Generation and sampling, completions cut short, scorers, and generation across ranks.


def test_generate_with_cache_and_left_padding_matches_naive_greedy():
    from generate import generate

    policy, tok = tiny(seed=4)
    prompts = [tok("Review the red lamp:")["input_ids"][:-1], tok("Hi")["input_ids"][:-1]]
    got = generate(
        policy, prompts, max_new_tokens=12, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id
    )
    with torch.no_grad():
        for prompt, completion in zip(prompts, got):
            ids = list(prompt)
            for _ in range(12):  # no cache, no padding: the whole sequence every step
                nxt = policy(input_ids=torch.tensor([ids])).logits[0, -1].argmax().item()
                ids.append(nxt)  # an ended completion keeps its EOS
                if nxt == tok.eos_token_id:
                    break
            assert completion == ids[len(prompt) :]
    again = generate(
        policy, prompts, 12, tok.eos_token_id, tok.pad_token_id, temperature=1.0, seed=7
    )
    assert again == generate(
        policy, prompts, 12, tok.eos_token_id, tok.pad_token_id, temperature=1.0, seed=7
    )


LOCKSTEP = """
import os, types
import torch, torch.distributed as dist
import generate
forwards = [0]

# a collective per forward, like FSDP2's all-gathers; rank 0 ends at once
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache):
        dist.all_reduce(torch.ones(1))
        forwards[0] += 1
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], 5)
        logits[..., 1 if dist.get_rank() == 0 else 3] = 1.0  # 1 is EOS
        return types.SimpleNamespace(logits=logits, past_key_values=None)

def lockstep(out):  # in a process group of two ranks
    result = generate.generate(Model(), [[2, 2]], max_new_tokens=6, eos_id=1, pad_id=0)
    with open(os.path.join(out, f"lockstep-{dist.get_rank()}.txt"), "w") as f:
        f.write(f"{forwards[0]} {result}")
"""


GATHERS = """
import contextlib, json, os
from unittest import mock
import torch, torch.distributed as dist
from torch.distributed.tensor import DTensor
import data, fsdp_setup, models, precision, generate, train_dpo

gathers = [0]


def counted(real):
    def gather(*args, **kwargs):
        gathers[0] += 1
        return real(*args, **kwargs)

    return gather


def nothing_kept(model, device):
    return []


def generations(rank, world, device):
    tok = data.load_tokenizer("tiny")
    config = models.load_model_config("tiny", tok)
    cfg = train_dpo.Config()
    mp_policy = precision.resolve_precision(precision.PrecisionConfig("fp32"), device).mp_policy

    def make():
        return train_dpo.prepare_model(cfg, models.build_model(config))

    model = fsdp_setup.build_sharded(
        make, models.open_weights("tiny", config, 4), mp_policy, device, cfg.fsdp
    )
    prompts = [tok("Review the red lamp:")["input_ids"][:-1], tok("Hi")["input_ids"][:-1]]
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state")
              for g in m._get_fsdp_state()._fsdp_param_groups]

    def settings():
        return [g.post_forward_mesh_info is not None for g in groups]

    def sharded():
        return all(
            isinstance(p, DTensor) and p.to_local().numel() <= -(-p.numel() // world)
            for p in model.parameters()
        )

    def run(new_tokens, per_token):
        old = mock.patch.object(generate, "_keep_gathered", nothing_kept)
        # per_token: the old path, each block resharded after each forward
        with old if per_token else contextlib.nullcontext():
            gathers[0] = 0
            out = generate.generate(model, prompts, new_tokens, eos_id=-1, pad_id=tok.pad_token_id)
        return {"gathers": gathers[0], "out": out, "settings": settings(), "sharded": sharded()}

    before = settings()
    # Generation first: the root settles its own setting at its first forward, as in training.
    result = {"kept": [run(2, False), run(8, False)], "per_token": [run(2, True), run(8, True)]}
    result["before"] = before
    return result


def leaders(rank):
    # Which ranks run on_rank0(per_node=True): as torchrun set LOCAL_RANK (one node), then as on
    # two nodes of one rank each.
    calls = []
    fsdp_setup.on_rank0(calls.append, rank, share=False, per_node=True)
    with mock.patch.dict(os.environ, {"LOCAL_RANK": "0"}):
        fsdp_setup.on_rank0(calls.append, rank, share=False, per_node=True)
    return calls


def main(argv):  # LOCKSTEP's check, then these; patched only while they run
    out = argv[argv.index("--out-dir") + 1]
    os.makedirs(out, exist_ok=True)
    # A rank left waiting in a collective: an error within a minute, not a hang.
    rank, world, device = fsdp_setup.init_distributed("cpu", timeout_s=60)
    try:
        lockstep(out)
        # FSDP2's all-gathers, whichever of the two it calls.
        with (
            mock.patch.object(dist, "all_gather_single", counted(dist.all_gather_single)),
            mock.patch.object(dist, "all_gather_into_tensor", counted(dist.all_gather_into_tensor)),
        ):
            result = generations(rank, world, device)
        result["leaders"] = leaders(rank)
        with open(os.path.join(out, f"gathers-{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()
"""


def generation_run(two_ranks):
    """two_ranks's "generation" run (LOCKSTEP's and GATHERS's checks), which must have succeeded."""
    out = two_ranks[0]["generation"]
    records = [(r["error"], r["exit"]) for r in run_records(out, 2)]
    assert records == [(None, None)] * 2, run_lines(two_ranks[1], out)[-3000:]
    return out


def test_generation_gathers_each_block_once_then_reshards_and_nodes_download_once_each(two_ranks):
    out = generation_run(two_ranks)
    results = [json.load(open(out / f"gathers-{r}.json")) for r in range(2)]
    # A download on one node: its first rank alone; on two nodes: each node's first rank.
    assert [r.pop("leaders") for r in results] == [[0, 0], [1]]
    assert results[0] == results[1]
    kept, per_token = results[0]["kept"], results[0]["per_token"]
    # Every group (4 blocks and the root) once per generation, however long; before, again for
    # each new token.
    assert kept[0]["gathers"] == kept[1]["gathers"] == 5
    assert [r["gathers"] >= 4 * tokens for r, tokens in zip(per_token, (2, 8))] == [True, True]
    for new, old, tokens in zip(kept, per_token, (2, 8)):
        assert new["out"] == old["out"] and all(len(c) == tokens for c in new["out"])
        # The old path left the root gathered after forward (the trainer's inference() reshards it).
        assert new["sharded"] and old["sharded"] is False
    # Training's settings back: the root (settled at its first forward, here generation's) stays
    # gathered for backward, the blocks reshard after forward.
    assert kept[1]["settings"] == per_token[1]["settings"] == [False] + [True] * 4
    assert results[0]["before"] == [True] * 5


def test_generation_keeps_ranks_in_lockstep_when_one_finishes_early(two_ranks):
    out = generation_run(two_ranks)
    # Both ranks ran 6 forwards (rank 0 kept stepping for rank 1, its EOS masked to padding), and
    # nothing hung.
    assert (out / "lockstep-0.txt").read_text() == "6 [[1]]"  # EOS at once: it ended
    assert (out / "lockstep-1.txt").read_text() == "6 [[3, 3, 3, 3, 3, 3]]"


def test_k_samples_repeat_the_prompts_cache_and_sample_each_rows_softmax():
    """Greedy K completions are K copies of the one greedy completion (the prompt's cache repeated,
    not recomputed); a top-p near 0 is greedy; each completion's draw depends on its prompt's place
    and number, not on the rest of the batch; and a row's draws follow softmax(logits / T), cut to
    the nucleus, by the binomial's 4-sigma bound."""
    policy = tiny_model(tiny_config()[0], seed=4)
    tok = load_tokenizer("tiny")
    prompts = [
        tok(t, add_special_tokens=False)["input_ids"] for t in ("Review a lamp:", "Hi", "Ok")
    ]
    args = (12, tok.eos_token_id, tok.pad_token_id)
    one = generate.generate(policy, prompts, *args)
    assert generate.generate(policy, prompts, *args, num_generations=4) == [
        c for c in one for _ in range(4)
    ]
    assert generate.generate(policy, prompts, *args, 1.0, 7, None, 1e-6, 2) == [
        c for c in one for _ in range(2)
    ]
    sampled = generate.generate(policy, prompts, *args, 1.0, 7, None, 0.9, 3)
    assert len(set(map(tuple, sampled))) > 3
    # "Hi" and "Ok" are as long, so alone they meet no other padding.
    alone = generate.generate(policy, prompts[2:], *args, 1.0, 7, None, 0.9, 3, first=2)
    assert sampled[6:] == alone
    assert generate.generate(policy, prompts[2:], *args, 1.0, 7, None, 0.9, 3, first=1) != alone
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 4000
    for temperature, top_p in ((0.5, 1.0), (1.0, 0.8)):
        probs = (logits[0] / temperature).softmax(-1)
        if top_p < 1:  # tokens 0 and 1 reach 0.8 at T = 1; the rest are cut
            probs = torch.cat([probs[:2] / probs[:2].sum(), torch.zeros(2)])
        g = torch.Generator().manual_seed(0)
        draws = [generate._next_tokens(logits, temperature, top_p, [g]).item() for _ in range(n)]
        share = torch.bincount(torch.tensor(draws), minlength=4) / n
        assert torch.all((share - probs).abs() <= 4 * (probs * (1 - probs) / n).sqrt() + 1e-9)


class _StopsAtSix(torch.nn.Module):
    """A causal LM for generate(): token "a" until a row holds 6 tokens (its prompt's and its
    own), then EOS."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache):
        logits = torch.zeros(*input_ids.shape, 384)
        ended = attention_mask.sum(-1) >= 6  # (B,)
        logits[:, -1, 100] = (~ended).float()  # "a" is byte 97, id 100
        logits[:, -1, 1] = ended.float()  # EOS
        return types.SimpleNamespace(logits=logits, past_key_values=None)


def _scores_by_length(prompts, completions):
    return [float(len(c)) for c in completions]


def test_a_full_disk_while_writing_rows_leaves_no_partial_file(tmp_path, monkeypatch):
    """generate.py's output: a write that fills the disk (its file half-written) is refused with one
    line naming the file, and neither the rows nor a .tmp stays."""

    class FullDisk(io.StringIO):  # a file that takes a few bytes, then finds the disk full
        def __init__(self, path, *args, **kwargs):
            super().__init__()
            pathlib.Path(path).write_text("{")

        def write(self, text):
            _full_disk()

    monkeypatch.setattr(generate, "open", FullDisk, raising=False)
    config = generate.GenerateConfig(out=str(tmp_path / "rows.jsonl"))
    rows = [{"prompt": "a", "responses": ["b"], "scores": [1.0], "cut": [False]}]
    with world_of_one(), pytest.raises(ValueError) as refused:
        generate.write_rows(config, rows, 1, 1.0)
    assert str(refused.value) == (
        f"{tmp_path / 'rows.jsonl'}: not written ([Errno 28] No space left on device)"
    )
    assert os.listdir(tmp_path) == []


def test_completions_cut_by_max_new_tokens_are_marked_and_counted_by_hand(
    tmp_path, capsys, monkeypatch
):
    """Prompts of 2, 4 and 6 bytes, a model that writes "a" until a row holds 6 tokens, then EOS,
    and --max-new-tokens 4: by hand, the first needs 4 "a" and EOS (5 tokens: cut after 4 "a"),
    the second writes "aa" and EOS, the third EOS alone. Rows mark the first cut, tokens count what
    was generated (4 + 3 + 1), and the sidecar counts one cut completion. --model
    tiny is the trainer's tiny model, weight for weight; missing default files name their cause."""
    tok = load_tokenizer("tiny")
    config = generate.GenerateConfig(
        out=str(tmp_path / "rows.jsonl"), max_new_tokens=4, num_generations=1, temperature=0
    )
    with world_of_one():
        rows, tokens = generate.generate_rows(
            _StopsAtSix(), tok, ["ab", "abcd", "abcdef"], config, _scores_by_length, CPU
        )
        assert generate.write_rows(config, rows, tokens, 1.0)["cut_completions"] == 1
    assert [row["responses"] for row in rows] == [["aaaa"], ["aa"], [""]]
    assert [row["cut"] for row in rows] == [[True], [False], [False]] and tokens == 8
    assert json.loads((tmp_path / "rows.jsonl.json").read_text())["cut_completions"] == 1
    tokenizer, model = generate._load_policy("tiny", torch.float32, 3)
    expected = models.open_weights("tiny", models.load_model_config("tiny", tok), 3)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert tokenizer.chat_template == tok.chat_template
    monkeypatch.chdir(tmp_path)  # a fresh folder: no demo files
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--out", str(tmp_path / "x.jsonl")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(
        "error: --model runs/cache/demo-sft/final and --data runs/cache/demo-train.jsonl: the "
        "demo's, not written yet: run python train_dpo.py once first"
    )


def _reward_model_folder(path, tokenizer, num_labels=1):
    config = transformers.LlamaConfig(
        vocab_size=384,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_scorers_match_the_reward_model_called_directly_and_bad_ones_fail_in_one_line(
    tmp_path, monkeypatch, capsys
):
    """A reward model scores each conversation as calling it on its chat template's text does
    (float32, 1e-5), and a text prompt + completion as calling it on that text with one EOS at its
    end (as train_dpo.py reads a text row, whatever the template); the demo's scorer and a
    module:function give their values; a head of two scores, a non-finite score, a missing module
    and bad prompt files fail with one line naming them, writing nothing."""
    prompts = ["Review the red lamp:", [{"role": "user", "content": "Hi"}], "Rate it:"]
    completions = [" Great and works well. 5/5", "Hello there", ""]
    cpu = torch.device("cpu")
    for tokenizer in (load_tokenizer("tiny"), transformers.ByT5Tokenizer()):
        folder = _reward_model_folder(tmp_path / f"rm{len(prompts)}", tokenizer)
        prompts = prompts[:3] if tokenizer.chat_template else prompts[::2]
        with world_of_one():
            got = generate.load_scorer(folder, cpu, torch.float32)(prompts, completions[::2])
        model = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
        for prompt, completion, score in zip(prompts, completions[::2], got):
            if isinstance(prompt, list):
                text = tokenizer.apply_chat_template(
                    prompt + [{"role": "assistant", "content": completion}], tokenize=False
                )
                ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
            else:
                # The byte tokenizer ends a text with its EOS itself.
                ids = tokenizer(prompt + completion, return_tensors="pt")
                assert ids.input_ids[0, -1] == tokenizer.eos_token_id
            with torch.no_grad():
                direct = model(**ids).logits[0, 0].item()
            # An order-1 output of a float32 forward on another batch shape: LOGP_REL of it.
            assert score == pytest.approx(direct, rel=LOGP_REL, abs=LOGP_REL)
        prompts.append("Hi")
    assert generate.load_scorer("demo", cpu, torch.float32)(
        ["p"] * 3, [" The lamp is great. 5/5", " It is awful. 1/5", " It is a lamp."]
    ) == [1.0, -1.0, 0.0]
    (tmp_path / "scorers.py").write_text(
        "def length(prompt, completion):\n    return len(prompt) + len(completion)\n"
        "def nan(prompt, completion):\n    return float('nan')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert generate.load_scorer("scorers:length", cpu, torch.float32)(["ab"], ["cde"]) == [5]
    two = _reward_model_folder(tmp_path / "two", transformers.ByT5Tokenizer(), num_labels=2)
    good = tmp_path / "prompts.jsonl"
    good.write_text('{"prompt": "Review the red lamp:"}\n')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    (tmp_path / "none.jsonl").write_text('{"prompt": "a"}\n\n{"chosen": "b"}\n')
    model = tmp_path / "policy"
    tiny_model(tiny_config()[0], seed=0).save_pretrained(model)
    load_tokenizer("tiny").save_pretrained(model)
    capsys.readouterr()
    for args, message in (
        (["--reward", "scorers:nan"], "--reward scorers:nan: gave nan, not a finite score"),
        (["--reward", "nosuch:score"], "--reward nosuch:score: cannot load it (No module named"),
        (["--reward", two], f"--reward {two}: its head gives 2 scores per text, not one"),
        (["--data", str(tmp_path / "bad.jsonl")], "bad.jsonl:2: invalid JSON (Expecting value"),
        (["--data", str(tmp_path / "none.jsonl")], "none.jsonl:3: field 'prompt' must be"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--model", str(tmp_path / "nosuch")], f"--model {tmp_path / 'nosuch'}: cannot load"),
    ):
        out = tmp_path / "rows.jsonl"
        with pytest.raises(SystemExit) as exit_:
            generate.main(
                ["--model", str(model), "--data", str(good), "--out", str(out), "--reward", "demo"]
                + ["--max-new-tokens", "2", *args]
            )
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: {message}") or message in err, err
        assert not out.exists()


# ---------------------------------------------------------------------------------------- memory.py
# The memory plan (--plan, --micro-batch-size auto) against the counted and measured peak.


FAILED_PLAN = """
from unittest import mock
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode
import train_dpo
real_setup = train_dpo.setup
real_loss = train_dpo.micro_batch_loss

def micro_batch_loss(*args, **kwargs):  # fails in rank 1's trace of its first step alone
    if dist.get_rank() == 1 and _get_current_dispatch_mode() is not None:
        raise AssertionError("NYI: a fake kernel missing on rank 1")
    return real_loss(*args, **kwargs)

def setup(cfg, device):  # the first step planned after setup, as on a GPU
    out = real_setup(cfg, device)
    out[0].planned_gb = train_dpo.plan_first_step(out[0])
    return out

def main(argv):  # patched for this run alone
    with (
        mock.patch.object(train_dpo, "setup", setup),
        mock.patch.object(train_dpo, "micro_batch_loss", micro_batch_loss),
    ):
        train_dpo.main(argv)
"""


def test_a_first_step_plan_that_fails_on_one_rank_skips_the_check_on_both_and_trains(two_ranks):
    """The first step's memory check, as a GPU run makes it, failing inside rank 1's trace: each
    rank warns once (rank 1 why, rank 0 that another rank could not plan), neither waits for the
    other, and both train every step to the end with no check at their first step."""
    outs, stderr = two_ranks  # which checks that the run ended cleanly on both ranks
    out = outs["failed_plan"]
    assert len(read_metrics(str(out))) == 2 and os.path.isdir(out / "final")
    why = "warning: memory check skipped on rank 1: AssertionError: NYI: a fake kernel missing"
    assert stderr.count(why) == 1, stderr[-3000:]
    lines = run_lines(stderr, out)
    assert lines.count("warning: memory check skipped: another rank could not plan") == 1
    assert "planned" not in lines


def _plan(tmp_path, capsys, *args):
    """train_dpo.py --plan of the tests' run with `args`, in this process: the memory.Plan behind
    what it printed, and its stderr."""
    plans = []
    real = memory.plan_memory

    def keep(*a, **kw):
        plans.append(real(*a, **kw))
        return plans[-1]

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(memory, "plan_memory", keep)
        train_dpo.main(trainer_args(tmp_path / "plan", "--plan", "--max-length", "128", *args))
    return plans[-1], capsys.readouterr().err


STATE = ("weights trained (float32 masters)", "reference", "AdamW's moments and steps")


def test_the_plan_counts_the_shards_by_hand_its_parts_add_up_and_offloaded_it_pins_nothing(
    tmp_path, capsys
):
    """--plan on 2 and 4 fake GPUs, the tiny model in float32 (the CPU's precision): its weights,
    reference and AdamW moments are 4, 4 and 8 bytes per parameter over the GPUs (and a step count
    per tensor); the parts of each size's peak add up to it; doubling the GPUs halves the shards;
    a micro-batch twice as large, with as many micro-batches of it held as gradients, changes the
    activations and the output layer's part alone; --ref precompute drops the reference and
    nothing else that a step keeps. No weights are read: the run's folder is never made.
    --cpu-offload with the offload policy a GPU run's models have (host memory pinned; fake
    tensors cannot be pinned): the plan pins nothing, which changes no byte count, and lists the
    policy's shards and AdamW's moments in host memory, the GPU's peak without them nor the
    gradients. The fake-tensor logger's level that the plan lowers while it traces is restored."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    model, _ = tiny(seed=0)
    n = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    plans = {}
    for gpus in (2, 4):
        plan, err = _plan(tmp_path, capsys, "--plan-gpus", str(gpus))
        plans[gpus] = plan
        assert plan.per_rank == 16 // gpus and list(plan.peaks) == memory.micro_batch_sizes(
            16 // gpus
        )
        state = plan.parts[1]
        assert state[STATE[0]] * memory.GB == 4 * n / gpus == state[STATE[1]] * memory.GB
        assert state[STATE[2]] * memory.GB == 8 * n / gpus + 4 * tensors
        for size, parts in plan.parts.items():
            assert sum(parts.values()) == pytest.approx(plan.peaks[size], rel=1e-12)
        assert f"memory plan for each GPU, of {gpus}:" in err
        # No card: no fits column, and the flag that gives one.
        assert f"peak at micro-batch {16 // gpus}" in err and "--gpu-memory GB tells" in err
        assert "micro-batch   peak GB\n" in err and "fits" not in err
    assert not (tmp_path / "plan").exists()
    # Twice the GPUs, half the shards (every weight's rows divide by 4).
    for part in STATE[:2]:
        assert plans[4].parts[1][part] == plans[2].parts[1][part] / 2
    one, two = plans[4].parts[1], plans[4].parts[2]
    grown = ("activations", "output layer and loss")
    assert {k: v for k, v in one.items() if k not in grown} == {
        k: v for k, v in two.items() if k not in grown
    }
    assert two["activations"] > 1.5 * one["activations"]
    precomputed, _ = _plan(tmp_path, capsys, "--plan-gpus", "4", "--ref", "precompute")
    kept = {k: v for k, v in plans[4].parts[1].items() if k in STATE and k != "reference"}
    assert "reference" not in precomputed.parts[1]
    assert {k: v for k, v in precomputed.parts[1].items() if k in STATE} == kept

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    pinned = []

    def pinning(pin_memory):  # build_sharded's policy, as on a GPU
        pinned.append(pin_memory)
        return CPUOffloadPolicy(pin_memory=True)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(fsdp_setup, "CPUOffloadPolicy", pinning)
        offload, err = _plan(tmp_path, capsys, "--plan-gpus", "2", "--cpu-offload")
    assert pinned and logger.level == level
    host = {STATE[0], STATE[2]}
    assert set(offload.host) == host and not host & set(offload.parts[8])
    for part in host:
        assert offload.host[part] == plans[2].parts[8][part]
    assert "gradients" not in offload.parts[8] and "in host memory" in err
    assert offload.parts[8]["activations"] == plans[2].parts[8]["activations"]


def test_the_plan_of_a_step_matches_the_step_measured_with_torchs_tracker(tmp_path, capsys):
    """The plan's peak against a real step's, on this CPU, with the GPU's fused output layer: one
    rank, the tiny model, micro-batches of 2 of 4 rows, every row of one length (so that every
    micro-batch is the longest), the third step's live tensor bytes as torch's FSDPMemTracker
    counts them (plus the reference's shards, which it does not see); and the first step's plan
    against the first step. Within the issue's 10%: the plan on a CPU grid is off by under 1% in
    shared rows (BENCHMARKS.md)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    rows = [{"prompt": "p" * 32, "chosen": "a" * 31, "rejected": "b" * 31}] * 8
    path = _write_jsonl(tmp_path / "rows.jsonl", rows)
    args = ("--data", path, "--max-length", "64", "--batch-size", "4", "--micro-batch-size", "2")
    real_step = train_dpo.train_step
    real_logps = response_logps
    peaks, trackers, first = [], [], []

    def step(run, optimizer, *rest):
        if len(peaks) == 1:
            peaks.append(0)
            return real_step(run, optimizer, *rest)
        if not peaks:
            first.append(train_dpo.plan_first_step(run))
        trackers.append(FSDPMemTracker(run.policy, optimizer))
        trackers[-1].track_external(run.reference)
        with trackers[-1]:
            stats = real_step(run, optimizer, *rest)
        peak = max(s["Total"] for s in trackers[-1].get_tracker_snapshot("peak").values())
        shards = sum(p.to_local().untyped_storage().nbytes() for p in run.reference.parameters())
        peaks.append((peak + shards) / memory.GB)
        return stats

    def resetting_logps(*rest):  # the tracker takes one forward per module and step
        if trackers:
            trackers[-1].reset_mod_stats()
        return real_logps(*rest)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(train_dpo, "train_step", step)
        monkeypatch.setattr(logps, "response_logps", resetting_logps)
        with logps.fused_head():
            run(tmp_path, "measured", *args, "--max-steps", "3")
    # Its own --max-length (64) comes after _plan's.
    plan, _ = _plan(tmp_path, capsys, *args, "--plan-gpus", "1")
    assert plan.peaks[2] == pytest.approx(peaks[-1], rel=0.1)
    # What a GPU run checks its first step against (train_dpo.plan_first_step): its own rows'
    # plan, without the AdamW moments that its update makes.
    assert first[0] == pytest.approx(peaks[0], rel=0.1)


@needs_cuda
def test_a_gpu_run_checks_its_first_steps_peak_against_its_plan(tmp_path, capsys):
    """On a GPU the run plans its first step and says so beside the measured peak, within 10% (no
    warning), at micro-batches of 2 of 4 rows of one length and of the demo's rows of many."""
    rows = [{"prompt": "p" * 32, "chosen": "a" * 31, "rejected": "b" * 31}] * 8
    path = _write_jsonl(tmp_path / "rows.jsonl", rows)
    for name, source in (("one-length", ("--data", path)), ("demo", ())):
        flags = ("--max-length", "64", "--batch-size", "4", "--micro-batch-size", "2")
        run(tmp_path, name, *source, *flags, "--max-steps", "2", device="cuda")
        lines = [line for line in capsys.readouterr().err.splitlines() if "planned" in line]
        assert len(lines) == 1 and lines[0].startswith("memory: peak "), lines


def test_auto_takes_the_largest_micro_batch_the_card_fits_and_bad_plans_say_why(tmp_path, capsys):
    """--micro-batch-size auto with a card that fits 2 rows, but not 4, of the 16 per GPU trains at
    2; without a card on a CPU, a model config that cannot be read, a card too small, and a step
    that fake tensors cannot run each end in one line and code 2."""
    plan, _ = _plan(tmp_path, capsys, "--plan-gpus", "1")
    card = (plan.peaks[2] + memory.RESERVED_GB) / memory.FITS * 1.0001
    assert memory.fits(plan.peaks[2], card) and not memory.fits(plan.peaks[4], card)
    auto = ("--micro-batch-size", "auto", "--gpu-memory", f"{card}", "--max-length", "128")
    out = run(tmp_path, "auto", *auto, "--max-steps", "1")
    err = capsys.readouterr().err
    assert "memory plan for each GPU, of 1:" in err and "peak at micro-batch 2 " in err
    saved = json.load(open(os.path.join(out, "final", "train_config.json")))
    assert saved["batching"]["micro_batch_size"] == 2
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    for args, message in (
        (("--micro-batch-size", "auto"), "--micro-batch-size auto needs a card to fit"),
        (("--model", str(tmp_path / "bad")), f"--model {tmp_path / 'bad'}: cannot load"),
        (("--micro-batch-size", "auto", "--gpu-memory", "1"), "--micro-batch-size auto: even 1"),
        # Transformers' grouped experts take bf16 alone on fake tensors (in training, any dtype).
        (
            ("--model", converted_model("qwen3_moe")),
            "the memory plan cannot trace this step on fake tensors: Expected inputs of BF16",
        ),
    ):
        with pytest.raises(SystemExit) as exit_info:
            _plan(tmp_path, capsys, *args)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and err[-1].startswith(f"error: {message}"), err


def test_micro_batch_tokens_auto_packs_as_many_rows_as_the_card_fits(tmp_path, capsys):
    """--packing --micro-batch-tokens auto with a card that fits the packed micro-batch of the 2
    longest rows but not of the 4 longest (the plan of packed rows): the run's micro-batches hold
    at most those 2 rows' tokens, counted by hand (each prompt and its two responses, in one
    row)."""
    pairs = demo_pairs("train")[:16]
    data_file = _write_jsonl(tmp_path / "pairs.jsonl", pairs)
    plan, _ = _plan(tmp_path, capsys, "--plan-gpus", "1", "--data", data_file, "--packing")
    card = (plan.peaks[2] + memory.RESERVED_GB) / memory.FITS * 1.0001
    assert memory.fits(plan.peaks[2], card) and not memory.fits(plan.peaks[4], card)
    auto = ("--packing", "--micro-batch-tokens", "auto", "--gpu-memory", f"{card}")
    out = run(
        tmp_path, "auto", "--data", data_file, *auto, "--max-length", "128", "--max-steps", "1"
    )
    rows = tokenize(pairs, load_tokenizer("tiny"), 128, DataConfig(max_length=128).prompt_limit)
    sizes = sorted(len(r["prompt"]) + len(r["chosen"]) + len(r["rejected"]) for r in rows)
    tokens = sizes[-1] + sizes[-2]
    assert (
        f"--micro-batch-tokens auto: {tokens}, the 2 longest rows packed" in capsys.readouterr().err
    )
    saved = json.load(open(os.path.join(out, "final", "train_config.json")))
    assert saved["batching"]["micro_batch_tokens"] == tokens


def _compiled_graphs(tmp_path, name, *args, plan_first=False):
    """A --compile run of one step in this process, its blocks compiled by Dynamo alone (the eager
    backend: no kernels to build): the graphs Dynamo captured. plan_first: as on a GPU, the first
    step is planned (train_dpo.plan_first_step) after setup, before it trains."""
    from torch._dynamo.utils import counters

    real_compile = torch.nn.Module.compile
    real_setup = train_dpo.setup
    planned = []

    def compile_eagerly(self, *args, **kwargs):
        return real_compile(self, *args, **{**kwargs, "backend": "eager"})

    def setup(cfg, device):
        out = real_setup(cfg, device)
        planned.append(train_dpo.plan_first_step(out[0]))
        return out

    torch._dynamo.reset()
    counters.clear()
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(torch.nn.Module, "compile", compile_eagerly)
        if plan_first:
            monkeypatch.setattr(train_dpo, "setup", setup)
        # Rows of their own and no held-out set: no evaluation's graphs to capture as well.
        rows = [{"prompt": "p" * 16, "chosen": "a" * 15, "rejected": "b" * 15}] * 4
        data = ("--data", _write_jsonl(tmp_path / f"{name}.jsonl", rows), "--max-length", "32")
        run(tmp_path, name, *data, "--compile", "--batch-size", "4", "--max-steps", "1", *args)
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert not plan_first or planned[0] > 0, planned
    return graphs


def test_a_planned_run_compiles_its_blocks_as_an_unplanned_one(tmp_path, capsys):
    """--compile with the micro-batch size given, against --micro-batch-size auto (the plan traced
    before the run's models are built) with its first step planned too, as a GPU run's is (after
    they are built, before they compile): Dynamo captures as many graphs in both. A model traced
    under the plan's dispatch mode with its blocks compiled would have Dynamo skip their code
    from then on, the run's blocks' too: no graphs, whichever plan did it."""
    given = _compiled_graphs(tmp_path, "given", "--micro-batch-size", "4")
    auto = ("--micro-batch-size", "auto", "--gpu-memory", "1000")
    planned = _compiled_graphs(tmp_path, "planned", *auto, plan_first=True)
    assert "peak at micro-batch 4 " in capsys.readouterr().err
    assert given > 0 and planned == given, (given, planned)


def test_the_plan_counts_the_buffers_cuda_flash_attentions_backward_makes_inside_itself():
    """FlashAttention-2's backward makes float32 buffers inside the op, which no dispatch mode sees
    and a GPU's caching allocator counts: the trace adds them at the op, here by hand, the GQA
    shape of a Llama (8 query heads, 2 key and value heads), 200 tokens (rounded up to 256), bf16:
    the query's gradient accumulated in float32 and the softmax's row sums (4 bytes each), and the
    key's and value's gradients expanded to every head (2 bytes); beside the op's own outputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    batch, heads, kv_heads, length, dim = 2, 8, 2, 200, 64
    with FakeTensorMode():
        query = torch.empty(batch, heads, length, dim, dtype=torch.bfloat16)
        key = torch.empty(batch, kv_heads, length, dim, dtype=torch.bfloat16)
        value = torch.empty_like(key)
        out = torch.empty_like(query)
        lse = torch.empty(batch, heads, length)
        seed = torch.empty((), dtype=torch.int64)
        with memory._Trace({}) as trace:
            torch.ops.aten._scaled_dot_product_flash_attention_backward(
                out, query, key, value, out, lse, None, None, length, length, 0.0, True, seed, seed
            )
    outputs = 2 * batch * (heads + 2 * kv_heads) * length * dim
    buffers = 4 * batch * 256 * heads * (dim + 1) + 2 * 2 * batch * length * heads * dim
    assert trace.peak(set(), False, False) == {"activations": outputs + buffers}


# ------------------------------------------------------------------------------------------ demo.py
# The demo's data, its SFT stage and its report.


def test_demo_is_deterministic_with_disjoint_held_out_items():
    train, held_out = demo_pairs("train"), demo_pairs("eval")
    assert all(
        score_completion(p["chosen"]) == 1 and score_completion(p["rejected"]) == -1 for p in train
    )
    assert train == demo_pairs("train") and len(train) >= 1024 and len(held_out) >= 128

    def item(p):
        return p["prompt"].split()[-1]

    assert not {item(p) for p in train} & {item(p) for p in held_out}
    assert all("5/5" in p["chosen"] and "1/5" in p["rejected"] for p in train + held_out)


def test_demo_reports_the_scorer_share_and_plots_the_curves(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "plot_metrics", PLOT_METRICS)
    out = run(
        tmp_path,
        "run",
        "--max-steps",
        "2",
        "--num-samples",
        "4",
        "--sample-max-tokens",
        "4",
        "--eval-before",
    )
    rows = read_metrics(out, "eval")
    assert [r["step"] for r in rows] == [0, 2] and all(
        0 <= r["samples/preferred"] <= 1 for r in rows
    )
    scores = [
        score_completion(s["completion"])
        for s in map(json.loads, open(os.path.join(out, "samples.jsonl")))
    ]
    assert rows[0]["samples/preferred"] == scores[:4].count(1) / 4
    assert open(os.path.join(out, "metrics.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    assert PLOT_METRICS(os.path.join(out, "metrics.jsonl"), str(tmp_path / "none.png")) is False
    assert not (tmp_path / "none.png").exists()


def _short_demo(real):
    """demo.warm_start with both stages cut to 2 steps: the SFT stage's flags and the DPO flags
    that follow it as `real` gives them, with the run's own flags last."""

    def short(*args):
        plan = real(*args)
        if plan and plan.sft_flags:
            plan.sft_flags += ["--max-steps", "2", "--batch-size", "16", "--eval-data", HELD_OUT]
        if plan:
            plan.dpo_flags += ["--max-steps", "2", "--num-samples", "2", "--sample-max-tokens", "4"]
        return plan

    return short


def test_the_default_run_trains_the_demo_sft_stage_once_resuming_it_then_dpo_from_it(
    tmp_path, capsys
):
    """The first run says the SFT stage comes first, and SIGTERM after the stage's first step
    stops it with a checkpoint and says to run the same command again; the second run goes on
    from that step, then runs DPO; a third finds the stage in the cache. --no-warm-start, a --model
    or a --data have no stage."""
    real = train_dpo.demo.warm_start
    real_step = train_dpo.train_step
    cache = str(tmp_path / "cache")
    folder = os.path.join(cache, "demo-sft")
    sft = os.path.join(folder, "final")
    flags = ["--cache-dir", cache, "--batch-size", "16", "--eval-data", HELD_OUT, *ON_CPU]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}

    def stopped_step(*args):  # SIGTERM as the stage's first step runs
        os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(train_dpo.demo, "warm_start", _short_demo(real))
        monkeypatch.setattr(train_dpo, "train_step", stopped_step)
        try:
            with pytest.raises(SystemExit) as exit_info:
                train_dpo.main(["--out-dir", str(tmp_path / "stopped"), *flags])
        finally:
            for s, handler in handlers.items():
                signal.signal(s, handler)
        assert exit_info.value.code == 128 + signal.SIGTERM
        err = capsys.readouterr().err.strip().splitlines()
        assert err[0] == f"demo: training its SFT stage first (once, cached in {folder}), then DPO"
        assert err[-1] == (
            f"stopped by a signal after step 1: saved {folder}/checkpoints/step-1; run the same "
            "command again: the demo's SFT stage goes on from there"
        )
        assert not os.path.exists(sft) and not (tmp_path / "stopped").exists()
        monkeypatch.setattr(train_dpo, "train_step", real_step)
        for name in ("resumed", "cached"):
            train_dpo.main(["--out-dir", str(tmp_path / name), *flags, "--eval-every", "1"])
            err = capsys.readouterr().err.strip().splitlines()
            if name == "resumed":
                assert err[0] == (
                    f"demo: its SFT stage goes on from its checkpoint in {folder}, then DPO"
                )
                assert f"resumed from {folder}/checkpoints/step-1 at step 1" in err
                assert f"saved {sft}" in err
                # Step 1 before the stop, step 2 after it.
                assert [r["step"] for r in read_metrics(folder)] == [1, 2]
            else:
                assert err[0] == f"demo: DPO from its SFT stage's model, {sft} (trained once)"
                assert f"saved {sft}" not in err
            out = str(tmp_path / name)
            assert json.load(open(os.path.join(out, "final", "train_config.json")))["model"] == sft
            # From the SFT model, against itself: ln 2; the demo's last line sums up.
            assert read_metrics(out)[0]["loss"] == pytest.approx(math.log(2), abs=F32_REL)
            evals = read_metrics(out, "eval")
            assert [r["step"] for r in evals] == [0, 1, 2]
            shares = [r["samples/preferred"] for r in evals]
            best = evals[shares.index(max(shares))]  # the first of equals
            assert err[-1].startswith(
                f"demo: the scorer prefers {shares[0]:.0%} of samples at step 0 and "
                f"{shares[-1]:.0%} at step 2 (best {max(shares):.0%}, at step {best['step']}); "
                "'Review the"
            )
    assert real(False, "tiny", ("demo",), True, cache) is None
    assert real(True, "gpt2", ("demo",), True, cache) is None
    assert real(True, "tiny", ("pairs.jsonl",), True, cache) is None
    assert real(True, "tiny", (), False, cache) is None


# Flags the DPO run refuses, each before the demo's SFT stage would start.
BAD_DEMO_FLAGS = {
    "micro-batch": ["--batch-size", "8", "--micro-batch-size", "3"],
    "resume": ["--resume", "latest"],
    "checkpoints": [],  # a new run where another run's checkpoints are
    "file": [],  # --out-dir names a file
}


@pytest.mark.parametrize("name", BAD_DEMO_FLAGS)
def test_the_demo_checks_the_dpo_runs_flags_before_its_sft_stage(tmp_path, capsys, name):
    """A bad flag of the DPO run, or an --out-dir it cannot write to, exits with code 2 and the
    one line the same run without the demo's stage gives (--no-warm-start), once the first line has
    said a stage comes first, and before any of the stage's steps: no stage folder is made."""
    cache = str(tmp_path / "cache")
    out = tmp_path / "out"
    if name == "checkpoints":
        (out / "checkpoints").mkdir(parents=True)
        (out / "checkpoints" / "latest").write_text("step-3")
    if name == "file":
        out.write_text("not a folder")
    flags = ["--out-dir", str(out), "--cache-dir", cache, *ON_CPU, *BAD_DEMO_FLAGS[name]]
    lines = []
    for warm_start in ("--warm-start", "--no-warm-start"):
        with pytest.raises(SystemExit) as exit_info:
            train_dpo.main([*flags, warm_start])
        assert exit_info.value.code == 2
        lines.append(capsys.readouterr().err.strip().splitlines())
    folder = os.path.join(cache, "demo-sft")
    assert lines[0][0] == f"demo: training its SFT stage first (once, cached in {folder}), then DPO"
    assert lines[0][-1] == lines[1][-1] and lines[1][-1].startswith("error: ")
    assert not os.path.exists(folder)


def test_demo_kto_rows_are_the_demo_reviews_labelled_by_style():
    rows = demo_unpaired()
    assert rows == demo_unpaired() and len(rows) == 2048
    assert {r["label"] for r in rows} == {True, False}
    assert all(score_completion(r["completion"]) == (1 if r["label"] else -1) for r in rows)


# --------------------------------------------------------------------------------------- whole runs
# train_dpo.main on 1 to N ranks end to end: recipes, flags, compiled and on-policy runs.


def test_tiny_run_learns_the_preference_and_exports_a_loadable_model(tmp_path):
    out = run(tmp_path, "e2e", "--max-steps", "12", "--eval-every", "6", "--eval-before")
    train, evals = read_metrics(out), read_metrics(out, "eval")
    keys = {
        "step",
        "split",
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "pairs_per_s",
        "elapsed_s",
        "padding_efficiency",
        "peak_mem_gb",
        "skipped",
    }
    assert [r["step"] for r in train] == list(range(1, 13)) and all(keys <= set(r) for r in train)
    assert all(
        0.5 < r["padding_efficiency"] <= 1 and r["peak_mem_gb"] > 0.1 and "mfu" not in r
        for r in train
    )
    assert train[0]["loss"] == pytest.approx(
        math.log(2), abs=F32_REL
    )  # policy == reference at the first step
    assert [r["step"] for r in evals] == [0, 6, 12] and evals[0]["loss"] == pytest.approx(
        math.log(2), abs=F32_REL
    )
    assert (
        math.log(2) > evals[1]["loss"] > evals[2]["loss"] and evals[2]["rewards/accuracies"] >= 0.9
    )

    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = os.path.join(out, "final")
    model, tok = (
        add_scored_head(AutoModelForCausalLM.from_pretrained(final)),
        AutoTokenizer.from_pretrained(final),
    )
    assert json.load(open(os.path.join(final, "train_config.json")))["lr"] == 1e-3
    # Independent check of the export: score the held-out set with the loaded model against a
    # freshly built reference; it must reproduce the logged final evaluation.
    reference, _ = tiny(seed=0)
    pairs = tokenize(HELD_OUT_PAIRS, tok, 512, 256)
    with torch.no_grad():
        out_pairs = forward_pairs(
            model.eval(),
            reference.eval(),
            collate_pairs(pairs, tok.pad_token_id),
            LossConfig(),
        )
    assert out_pairs.losses.mean().item() == pytest.approx(
        evals[-1]["loss"], **_rounding_bound("loss", evals[-1], beta=0.1)
    )
    accuracy = (out_pairs.chosen_rewards > out_pairs.rejected_rewards).float().mean().item()
    assert accuracy == pytest.approx(evals[-1]["rewards/accuracies"])


def test_learning_rate_schedules_and_warmup_ratio_by_hand():
    def lrs(total=10, **config):
        config = schedule.ScheduleConfig(warmup_steps=2, **config)
        return [schedule.learning_rate(step, 1.0, config, total) for step in range(total)]

    # Warmup (step + 1) / (warmup + 1), then from 1 down to a tenth at the last step.
    cosine = lrs()
    assert cosine[:3] == pytest.approx([1 / 3, 2 / 3, 1.0]) and cosine[-1] == pytest.approx(0.1)
    assert cosine[5] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 7)))
    # transformers' linear decay: (total - step) / (total - warmup), 0 one step after the last.
    assert lrs(lr_schedule="linear")[2:] == pytest.approx([(10 - s) / 8 for s in range(2, 10)])
    assert lrs(lr_schedule="constant")[2:] == [1.0] * 8
    # A ratio of the steps replaces --warmup-steps: 0.25 of 20 is 5 steps.
    ratio = lrs(total=20, warmup_ratio=0.25)
    assert ratio[:6] == pytest.approx([1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0])
    with pytest.raises(ValueError, match="--warmup-ratio in"):
        schedule.ScheduleConfig(warmup_ratio=1.0)


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    a = run(tmp_path, "a", "--max-steps", "3")
    b = run(tmp_path, "b", "--max-steps", "3", "--micro-batch-size", "4")
    _assert_same_rows(read_metrics(a), read_metrics(b), ("loss", "grad_norm", "lr"))
    wa, wb = load_safetensors(os.path.join(a, "final")), load_safetensors(os.path.join(b, "final"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=ADAM_ATOL)


# The oracle's run: 3 steps of 16 pairs at a peak lr of 1e-3 after 2 warmup steps (trainer_args),
# AdamW with weight decay 0.5, gradients clipped to a norm of 0.5 (step 1's is about 5), float32.
ORACLE = dict(lr=1e-3, weight_decay=0.5, max_grad_norm=0.5)
ORACLE_ARGS = (
    *("--max-steps", "3", "--micro-batch-size", "4", "--precision", "fp32", "--lr", "1e-3"),
    *("--weight-decay", "0.5", "--max-grad-norm", "0.5"),
)
# Linear warmup over 2 steps to the peak, (step + 1) / 3 of it, then the peak: the cosine decay to
# a tenth starts at step 3, the last, where it has not moved yet.
ORACLE_LRS = [1e-3 / 3, 2e-3 / 3, 1e-3]


@pytest.fixture(scope="module")
def plain_dpo():
    """The oracle's 3 steps written plainly, on the trainer's demo pairs in the trainer's order:
    the Hugging Face model whole, each response's log-prob from a float32 log_softmax over all the
    logits of its own unpadded row, DPO's loss by its formula, mean over the batch, one backward,
    torch's clip_grad_norm_, torch.optim.AdamW. Returns ({"loss", "grad_norm"}: per step, the
    weights before, the weights after)."""
    config, tok = tiny_config()
    demo_train = demo_files(CACHE, write_jsonl)["train"]
    tokens, _, _ = prepare_data(DataConfig(data=(demo_train,)), tok, CACHE)
    # The trainer groups by each row's shared length, in either layout.
    lengths = row_lengths(tokens.lengths)
    order = build_batches(len(tokens), 16, seed=0, epoch=0, lengths=lengths)
    policy = tiny_model(config, seed=0).eval()
    reference = copy.deepcopy(policy).requires_grad_(False)
    before = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    optimizer = torch.optim.AdamW(policy.parameters(), weight_decay=ORACLE["weight_decay"])

    def logp(model, prompt, response):
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
        log_probs = torch.log_softmax(logits.float(), -1)  # (T, V)
        # The logits at t predict token t + 1.
        at = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
        return log_probs[at, torch.tensor(response)].sum()

    steps = {"loss": [], "grad_norm": []}
    for batch, lr in zip(order[:3], ORACLE_LRS):
        for group in optimizer.param_groups:
            group["lr"] = lr
        total = 0.0
        for i in batch:
            pair = as_pair(tokens[i])
            margin = 0.0
            for key, sign in (("chosen", 1), ("rejected", -1)):
                with torch.no_grad():
                    ref = logp(reference, pair["prompt"], pair[key])
                margin = margin + sign * (logp(policy, pair["prompt"], pair[key]) - ref)
            total = total - torch.nn.functional.logsigmoid(0.1 * margin)
        loss = total / len(batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), ORACLE["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad()
        steps["loss"].append(loss.item())
        steps["grad_norm"].append(norm.item())
    after = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    return steps, before, after


def _assert_update_close(weights, expected, before, rel):
    """The weights within `rel` of the expected ones, measured against the size of the update
    (weights after minus before): Adam's first steps move every weight by about lr, so a bound on
    the weights alone would hide a wrong update."""
    names = [k for k in expected if k in weights]
    assert len(names) >= len(weights) - 1, set(weights) ^ set(expected)
    error = sum((weights[k] - expected[k]).double().square().sum() for k in names) ** 0.5
    update = sum((expected[k] - before[k]).double().square().sum() for k in names) ** 0.5
    assert error < rel * update, (error, update)


def test_train_step_matches_a_plain_dpo_loop(plain_dpo, tmp_path):
    """train_step called directly, 3 times at hand-computed learning rates, on one rank with 4
    micro-batches a step: the losses, the gradient norms before clipping (which binds) and the
    weights of the plain loop. Dividing the loss by the micro-batch instead of the rank's pairs
    changes the norms; ignoring the weight decay or the clipping changes the weights."""
    import checkpoint

    expected, before, after = plain_dpo
    cfg = train_dpo.Config(
        dataset=DataConfig(eval_data=(HELD_OUT,), cache_dir=CACHE),
        batching=BatchConfig(batch_size=16, micro_batch_size=4, max_steps=3),
        mixed_precision=PrecisionConfig("fp32", max_grad_norm=ORACLE["max_grad_norm"]),
        fsdp=FSDPConfig(device="cpu"),
        lr=ORACLE["lr"],
        weight_decay=ORACLE["weight_decay"],
        out_dir=str(tmp_path),
    )
    stop = checkpoint.StopRequest()
    with world_of_one():
        run_, optimizer = train_dpo.setup(cfg, CPU)
        try:
            stats = [
                train_dpo.train_step(run_, optimizer, run_.steps(step), ORACLE_LRS[step], stop)
                for step in range(3)
            ]
        finally:
            stop.restore()
        weights = full_state(run_.policy)
    assert [s.means["loss"] for s in stats] == pytest.approx(expected["loss"], rel=RUN_REL)
    assert [s.grad_norm for s in stats] == pytest.approx(expected["grad_norm"], rel=GRAD_NORM_REL)
    assert expected["grad_norm"][0] > 4 * ORACLE["max_grad_norm"]
    assert not any(s.skipped or s.stop_requested for s in stats)
    _assert_update_close(weights, after, before, rel=RUN_REL)


def _refused(config, row_inputs):
    return "a test's refusal"


def test_the_trainer_trains_alike_in_shared_and_separate_rows(tmp_path, monkeypatch, capsys):
    """3 float32 steps of the trainer with --ref precompute, --lora-rank, --ld-alpha and
    --use-weighting: per-step losses and gradient norms shared (the default) against separate rows
    up to rounding (_rounding_bound), from the same batches; fewer FLOPs shared. The separate run is
    a model not listed as taking the mask, which falls back with a notice: the path
    --no-share-prompt takes."""
    assert not tyro.cli(train_dpo.Config, args=["--no-share-prompt"]).batching.share_prompt
    # 48 pairs: 3 steps of 16 and a short --ref precompute pass.
    data = write_jsonl(str(tmp_path / "train-48.jsonl"), demo_pairs("train")[:48])
    args = ("--data", data, "--eval-data", HELD_OUT, "--max-steps", "3", "--no-group-by-length")
    args += ("--lr", "1e-3", "--ref", "precompute", "--lora-rank", "8", "--ld-alpha", "0.5")
    args += ("--use-weighting",)
    # Each computes its own reference table, in its own layout.
    shared = run(tmp_path, "shared", *args, "--cache-dir", str(tmp_path / "cache-1"))
    assert "shared prompt" not in capsys.readouterr().err
    monkeypatch.setattr(models, "shared_prompt_refusal", _refused)
    separate = run(tmp_path, "separate", *args, "--cache-dir", str(tmp_path / "cache-2"))
    assert (
        "note: llama with sdpa attention does not score a shared prompt exactly (a test's "
        "refusal): separate rows (--no-share-prompt)" in capsys.readouterr().err
    )
    _assert_same_rows(read_metrics(shared), read_metrics(separate), ("loss", "grad_norm"))
    flops = [read_metrics(out)[0]["flops"] for out in (shared, separate)]
    assert flops[0] < flops[1]


# Packed against unpacked: pairs in shared rows (DPO), pairs in separate rows
# (LD-DPO, WPO, --ref precompute), K-response rows (listwise), unpaired rows (KTO's mismatched
# completions, a second forward) and ORPO's scored prompts.
PACKED_GRID = {
    "pairs": (),
    "separate": (
        "--no-share-prompt",
        "--ld-alpha",
        "0.5",
        "--use-weighting",
        "--ref",
        "precompute",
    ),
    "krows": ("--loss", "plackett_luce"),
    "kto": ("--loss", "kto"),
    "orpo": ("--loss", "orpo"),
}


def start_packed_grid(request, folder):
    """Background's start of packed_grid: PACKED_GRID's runs, 3 float32 steps of 8 rows, each
    padded (micro-batches of 4 rows) and packed (of at most 700 tokens), the K-row one packed
    saving at step 2 and then resumed from that checkpoint; in one start of one rank."""
    k_files = request.getfixturevalue("k_files")
    kto_file = request.getfixturevalue("kto_file")
    # --ref precompute reads every row: 48 pairs.
    pairs = write_jsonl(str(folder / "train-48.jsonl"), demo_pairs("train")[:48])
    files = {"krows": k_files[0], "kto": kto_file, "separate": pairs}
    outs = {}
    runs = []
    packing = ("--packing", "--micro-batch-tokens", "700")
    for name, flags in PACKED_GRID.items():
        args = ("--max-steps", "3", "--batch-size", "8", "--micro-batch-size", "4", "--lr", "1e-3")
        # Rows of unlike lengths side by side: padded micro-batches have padding to remove.
        args += ("--no-group-by-length", *flags)
        if name in files:
            args += ("--data", files[name], "--eval-data", files[name])
        save = ("--save-every", "2" if name == "krows" else "0")
        for layout, extra in (("plain", ()), ("packed", (*packing, *save))):
            outs[name, layout] = folder / f"{name}-{layout}"
            runs.append(trainer_args(outs[name, layout], *args, *extra))
        if name == "krows":
            outs[name, "resumed"] = folder / "krows-resumed"
            step_2 = str(outs[name, "packed"] / "checkpoints" / "step-2")
            runs.append(trainer_args(outs[name, "resumed"], *args, *packing, "--resume", step_2))
    return run_ranks, 1, outs, runs, []


@pytest.fixture(scope="module")
def packed_grid(background):
    return background.result("packed_grid")


def test_hsdp_two_replicas_of_two_shards_match_one_rank_and_resume_as_fsdp_on_four(
    six_steps, hsdp_runs, tmp_path, capsys
):
    with pytest.raises(SystemExit) as exit_info:
        run(tmp_path, "one", "--replicas", "2")
    assert (
        exit_info.value.code == 2
        and "--replicas 2 does not divide the 1 ranks" in capsys.readouterr().err
    )
    outs, proc = hsdp_runs
    hsdp = outs["hsdp"]
    fsdp = outs["fsdp"]
    assert_runs_ended(proc, outs.values(), 4)
    hsdp_err, fsdp_err = proc.stderr.split(f"saved {hsdp / 'final'}")
    assert "4 rank(s) as 2 replicas x 2 shards (HSDP)" in hsdp_err  # the policy's mesh, as built
    _assert_same_run(six_steps[0], str(hsdp), exact=False)
    assert (
        "4 rank(s) on cpu" in fsdp_err
        and f"resumed from {hsdp / 'checkpoints' / 'step-4'} at step 4" in fsdp_err
    )
    assert "not restored" not in fsdp_err  # same world: RNG too
    _assert_same_rows(read_metrics(six_steps[0])[4:], read_metrics(str(fsdp)))
    wa, wb = (
        load_safetensors(os.path.join(six_steps[0], "final")),
        load_safetensors(str(fsdp / "final")),
    )
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=ADAM_ATOL)


def test_sigusr1_from_outside_saves_the_finished_step_and_exits_promptly(processes):
    # SIGUSR1 (SLURM's warning before the time limit) as SIGTERM (the preempted two-rank test sends
    # that one): processes's "sigusr1".
    (out, code, err), waited = processes[0]["sigusr1"], processes[1]
    assert waited < 60 and code == 128 + signal.SIGUSR1, err
    last = read_metrics(str(out))[-1]["step"]
    assert (out / "checkpoints" / "latest").read_text() == f"step-{last}" and 2 <= last < 200
    run(
        out.parent, out.name, "--max-steps", str(last + 1), "--resume", "latest"
    )  # a shorter run: allowed
    assert [r["step"] for r in read_metrics(str(out))] == list(
        range(1, last + 2)
    )  # no step lost or repeated


def test_a_run_killed_during_an_async_save_resumes_from_the_last_complete_one(six_steps, processes):
    out, code, err = processes[0]["killed"]
    assert code == -signal.SIGKILL, err[-3000:]
    saved = out / "checkpoints"
    assert (saved / "latest").read_text() == "step-2" and (saved / "step-4.tmp").is_dir()
    assert sorted(os.listdir(saved)) == ["latest", "step-2", "step-4.tmp"]
    # Step 2 was written while steps 3 and 4 trained: from it, the run ends exactly as the
    # uninterrupted one.
    run(out.parent, out.name, *SIX, "--save-every", "2", "--async-save", "--resume", "latest")
    _assert_same_run(six_steps[0], str(out))
    assert sorted(os.listdir(saved)) == ["latest", "step-2", "step-4", "step-6"]


@pytest.mark.parametrize("name", PACKED_GRID)
def test_packed_rows_train_as_unpacked_ones(packed_grid, name):
    """3 float32 steps of 8 rows packed (--packing, micro-batches of at most 700 tokens) against the
    same steps in padded micro-batches of 4 rows (packed_grid): the same per-step losses and
    gradient norms, and held-out metrics, up to rounding (_rounding_bound); step 1's DPO loss is
    ln 2 (the policy is the reference). K-response rows packed resume bit for bit from a
    checkpoint."""
    outs, proc = packed_grid
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = str(outs[name, "plain"])
    packed = str(outs[name, "packed"])
    _assert_same_rows(read_metrics(packed), read_metrics(plain), ("loss", "grad_norm"))
    _assert_same_rows(read_metrics(packed, "eval"), read_metrics(plain, "eval"), ("loss",))
    # Packed: no padding; padded: some.
    assert [r["padding_efficiency"] for r in read_metrics(packed)] == [1.0] * 3
    assert min(r["padding_efficiency"] for r in read_metrics(plain)) < 1
    if name == "pairs":
        assert read_metrics(packed)[0]["loss"] == pytest.approx(math.log(2), rel=F32_EPS)
    if name == "krows":
        # Resumed from step 2's checkpoint: step 3, the evaluation and the export, every bit.
        resumed = str(outs[name, "resumed"])
        _assert_same_rows(read_metrics(resumed), read_metrics(packed)[2:], exact=True)
        evals = [read_metrics(out, "eval") for out in (resumed, packed)]
        _assert_same_rows(*evals, PAIR_METRICS, exact=True)
        wa, wb = _final_weights(resumed), _final_weights(packed)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_rounding_bounds_still_tell_one_step_from_the_next(six_steps):
    """A negative control for _rounding_bound: two consecutive steps of one run differ, in every
    quantity it bounds, by more than a run differing only in rounding may."""
    rows = read_metrics(six_steps[0])
    keys = [k for k in TRAIN_KEYS if k not in ("rewards/accuracies", "lr")]
    for later, earlier in zip(rows[1:], rows):
        for key in keys:
            bound = _rounding_bound(key, earlier, beta=0.1)
            assert later[key] != pytest.approx(earlier[key], **bound), (later["step"], key)


# --ref precompute's runs: few pairs, as its pass reads them all; the two-rank run is two_ranks's
# "lora".
REF_DATA = (
    "--data",
    write_jsonl(os.path.join(CACHE, "train-128.jsonl"), demo_pairs("train")[:128]),
    "--eval-data",
    write_jsonl(os.path.join(CACHE, "eval-32.jsonl"), demo_pairs("eval")[:32]),
    *("--max-steps", "3", "--micro-batch-size", "8"),
)
REF_LORA = ("--lora-rank", "8", "--activation-checkpointing", "--ref", "precompute")
# An evaluation of 37 held-out pairs (ranks get 19 and 18 + a dummy) with samples; two_ranks's
# "eval".
EVAL_ARGS = (
    "--eval-data",
    write_jsonl(os.path.join(CACHE, "eval-37.jsonl"), demo_pairs("eval")[:37]),
    "--max-steps",
    "2",
    "--micro-batch-size",
    "4",
    "--num-samples",
    "3",
    "--sample-temperature",
    "1.0",
    "--sample-max-tokens",
    "8",
    "--eval-before",
    "--export-dtype",
    "bfloat16",
)


def test_two_ranks_match_one_with_every_objective_option_on(objectives_run, two_ranks):
    # The syncs change the reference from step 3 on, alike on one rank and two.
    _assert_same_run(objectives_run, str(two_ranks[0]["objectives"]), exact=False)


def test_two_ranks_train_like_the_plain_dpo_loop(plain_dpo, two_ranks):
    """The whole trainer on two ranks of 2 micro-batches each: the logged losses, gradient norms
    and learning rates (schedule.learning_rate against the hand-computed ones) and the exported
    weights."""
    expected, before, after = plain_dpo
    out = str(two_ranks[0]["oracle"])
    rows = read_metrics(out)
    assert [r["loss"] for r in rows] == pytest.approx(expected["loss"], rel=RUN_REL)
    assert [r["grad_norm"] for r in rows] == pytest.approx(expected["grad_norm"], rel=GRAD_NORM_REL)
    # float64 on both sides, through JSON (exact): a few roundings of 2^-53.
    assert [r["lr"] for r in rows] == pytest.approx(ORACLE_LRS, rel=1e-12)
    _assert_update_close(load_safetensors(os.path.join(out, "final")), after, before, rel=RUN_REL)


def test_ref_precompute_matches_online_reference_and_is_cached_by_its_inputs(
    two_ranks, tmp_path, capsys
):
    data, cache = REF_DATA, tmp_path / "cache"
    online = run(tmp_path, "online", *data)
    out = run(tmp_path, "pre", *data, "--ref", "precompute", "--cache-dir", str(cache))
    assert "reference log-probs: computed 160 rows" in capsys.readouterr().err
    # The same training as with a resident reference model, up to float rounding: the reference ran
    # on other, differently padded batches. So not the same reward accuracy at step 1, where every
    # margin is exactly 0 online and +-1e-7 here, and weights within ADAM_ATOL after 3 Adam steps.
    _assert_same_run(
        online, out, exact=False, keys=[k for k in PAIR_METRICS if k != "rewards/accuracies"]
    )
    (name,) = [f for f in os.listdir(cache) if f.startswith("ref-")]
    table = load_safetensors_file(str(cache / name))
    assert (
        table["train"].shape == (128, 2)
        and table["eval"].shape == (32, 2)
        and table["train"].lt(0).all()
    )
    # Two ranks each fill their own rows; the sum over ranks puts every pair's values in place
    # exactly once. The two ranks train LoRA (with activation checkpointing): its reference, the
    # base model with the adapters off, is the same table.
    two = two_ranks[0]["lora"]
    for split, values in load_safetensors_file(str(two.parent / "ref-cache" / name)).items():
        torch.testing.assert_close(values, table[split], rtol=LOGP_REL, atol=LOGP_REL)
    # Reused by another run with the same inputs (LoRA too), and recomputed when an input changes:
    # the length limit.
    one = run(tmp_path, "again", *data, *REF_LORA, "--cache-dir", str(cache))
    assert f"{name} (cached)" in capsys.readouterr().err
    # LoRA: 1 rank and 2 agree.
    _assert_same_rows(read_metrics(one), read_metrics(two))
    adapters_one, adapters_two = _adapters(one), _adapters(two)
    assert adapters_one.keys() == adapters_two.keys() and len(adapters_one) == 4 * 7 * 2
    for k in adapters_one:
        torch.testing.assert_close(adapters_two[k], adapters_one[k], rtol=0, atol=ADAM_ATOL)
    # A shorter run: other pairs (the length limit), another table.
    short = ("--ref", "precompute", "--cache-dir", str(cache), "--max-steps", "1")
    short += ("--max-length", "40", "--max-prompt-length", "20")
    run(tmp_path, "short", *data, *short)
    assert "reference log-probs: computed" in capsys.readouterr().err
    assert len([f for f in os.listdir(cache) if f.startswith("ref-")]) == 2
    # LD-DPO's sums are another table, of the same sums as the policy's: at step 1 (policy =
    # reference) the log-ratios are 0 and the loss ln 2, which a table of plain sums would not give.
    ld = run(tmp_path, "ld", *data, *short, "--ld-alpha", "0.3")
    assert "reference log-probs: computed" in capsys.readouterr().err
    assert len([f for f in os.listdir(cache) if f.startswith("ref-")]) == 3
    first = read_metrics(ld)[0]
    assert first["loss"] == pytest.approx(math.log(2), **_rounding_bound("loss", first, beta=0.1))


BAD_ROW = '{"prompt": "a", "chosen": "b", "rejected": 3}\n'


def test_bad_input_from_the_command_line_has_no_traceback(processes, tmp_path, capsys):
    out, code, err = processes[0]["bad"]
    bad = out.parent / "bad.jsonl"
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().count("\n") == 0 and err.startswith(f"error: {bad}:1: field 'rejected'")
    # A config's own check fails through tyro's parser, in main() as from the command line.
    with pytest.raises(SystemExit) as exit_info:
        train_dpo.main(
            [
                "--out-dir",
                str(tmp_path / "o"),
                *ON_CPU,
                "--no-warm-start",
                "--batch-size",
                "30",
                "--micro-batch-size",
                "4",
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: --batch-size 30 must be a multiple")
    assert not (tmp_path / "o").exists()


@needs_cuda
def test_torchrun_with_nccl_matches_the_one_rank_cpu_run(six_steps, tmp_path):
    proc = torchrun(min(GPUS, 2), str(tmp_path / "gpu"), *SIX, "--precision", "fp32", device="cuda")
    assert proc.returncode == 0 and "nccl" in proc.stderr, proc.stderr[-3000:]
    # float32 on both, but other kernels sum in other orders: metrics within 1e-4, weights within
    # ten times the rounding allowance of two CPU runs.
    _assert_same_run(six_steps[0], str(tmp_path / "gpu"), exact=False, weight_atol=10 * ADAM_ATOL)


def test_sft_stage_logs_hf_token_mean_nll_then_feeds_dpo(tmp_path):
    out = run(
        tmp_path,
        "sft",
        "--loss",
        "sft",
        "--max-steps",
        "2",
        "--micro-batch-size",
        "4",
        "--num-samples",
        "2",
        "--eval-before",
    )
    # Step 1's loss (before any update) is the HF model's own token-mean cross-entropy over the
    # chosen rows of the first global batch, accumulated here over 4 micro-batches.
    policy, tok = tiny(seed=0)
    tokens, _, _ = prepare_data(
        DataConfig(data=(os.path.join(CACHE, "demo-train.jsonl"),)), tok, CACHE
    )  # the run's
    first = build_batches(len(tokens), 16, seed=0, epoch=0, lengths=row_lengths(tokens.lengths))[0]
    nll = count = 0.0
    with torch.no_grad():
        for i in first:
            p = as_pair(tokens[i])
            ids = torch.tensor([p["prompt"] + p["chosen"]])
            labels = torch.tensor([[-100] * len(p["prompt"]) + p["chosen"]])
            nll += policy(input_ids=ids, labels=labels).loss.item() * len(p["chosen"])
            count += len(p["chosen"])
    (step1, _) = read_metrics(out)
    assert step1["loss"] == pytest.approx(nll / count, rel=LOGP_REL)
    assert "logps/chosen" in step1 and not {"rewards/accuracies", "logps/rejected"} & set(
        step1
    )  # not computed
    assert read_metrics(out, "eval")[-1]["loss"] < read_metrics(out, "eval")[0]["loss"]
    # The classic pipeline: DPO starts from the SFT export (reference = that model, so the loss
    # starts at ln 2).
    dpo = run(
        tmp_path,
        "dpo",
        "--model",
        os.path.join(out, "final"),
        "--lr",
        "1e-4",
        "--max-steps",
        "1",
        "--num-samples",
        "0",
    )
    assert read_metrics(dpo)[0]["loss"] == pytest.approx(math.log(2), abs=F32_REL)
    assert not os.path.exists(os.path.join(dpo, "samples.jsonl"))


def test_dropout_is_off_unless_asked_so_the_first_step_has_zero_rewards(tmp_path):
    import transformers

    _, tok = tiny(seed=0)  # GPT-2's config has dropout: 0.1 on embeddings, attention and residuals
    config = transformers.GPT2Config(
        vocab_size=len(tok),
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=2,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    args = (
        "--model",
        str(tmp_path / "gpt2"),
        "--max-length",
        "128",
        "--max-steps",
        "1",
        "--lr",
        "1e-4",
    )
    off = read_metrics(run(tmp_path, "off", *args))[0]
    on = read_metrics(run(tmp_path, "on", *args, "--dropout"))[0]
    # Policy == reference at step 1: without dropout every log-ratio is exactly 0 and the loss is ln
    # 2.
    assert off["rewards/chosen"] == off["rewards/rejected"] == 0 and off["loss"] == pytest.approx(
        math.log(2), abs=F32_REL
    )
    assert (
        on["rewards/chosen"] != 0 and on["rewards/rejected"] != 0
    )  # dropout's noise, kept when asked for


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--loss", "aot", "--use-weighting"], "aot and aot_pair sort pairs across the batch"),
        (["--loss", "sft", "--ld-alpha", "0.5"], "--ld-alpha goes only with --loss aot, aot_pair"),
        (
            ["--loss", "dpo", "--loss", "sft", "--ld-alpha", "0.5"],
            "(sft's and orpo's NLL take plain log-probs), got --loss dpo sft",
        ),
        (["--ld-alpha", "1.5"], "--ld-alpha must be in [0, 1]"),
        (
            ["--loss", "nca_pair", "--f-divergence-type", "forward_kl"],
            "--f-divergence-type goes only with --loss discopop, dpo,",
        ),
        (
            ["--sync-ref-model", "--ref", "precompute"],
            "needs a reference model (--ref online): got --loss dpo --ref precompute",
        ),
        (["--sync-ref-model", "--loss", "simpo"], "--sync-ref-model needs a reference model"),
        (
            ["--sync-ref-model", "--lora-rank", "8"],
            "--sync-ref-model: with --lora-rank the reference is the base",
        ),
        (
            ["--sync-ref-model", "--ref-model-sync-steps", "0"],
            "--ref-model-sync-steps must be >= 1",
        ),
        (["--ref-model-mixup-alpha", "2"], "--ref-model-mixup-alpha must be in [0, 1]"),
        (["--async-save", "--cpu-offload"], "--async-save with --cpu-offload would copy the"),
        (["--loss", "sft", "--use-weighting"], "needs a preference --loss (not sft alone)"),
        (
            ["--loss", "dpo", "--loss", "sft", "--loss-weights", "1"],
            "--loss-weights: 1 weights for 2 --loss",
        ),
        # What the parser refuses: the same one line, before the demo's SFT stage would start.
        (
            ["--loss", "nonsense"],
            "error: invalid choice 'nonsense' for argument '--loss'. Expected one of ('dpo',",
        ),
        (["--lr", "abc"], "error: --lr: no type matching {None}|FLOAT could be instantiated"),
        (["--micro-batch-size", "x"], "error: --micro-batch-size: no type matching {None}|INT|"),
        (["--nonsense"], "error: Unrecognized options: --nonsense"),
        (["--max-steps"], "error: Missing value for argument '--max-steps'"),
        (["--lr", "-1"], "error: --lr must be a finite number >= 0, got -1.0"),
        (["--weight-decay", "nan"], "error: --weight-decay must be a finite number >= 0, got nan"),
        (["--seed", str(2**64)], "error: --seed must be in [0, 2^63), got 18446744073709551616"),
        (["--sample-temperature", "nan"], "error: --sample-temperature must be >= 0, got nan"),
        (["--missing-eos-penalty", "inf"], "error: --missing-eos-penalty must be a finite number"),
        (["--lr", "inf"], "error: --lr must be a finite number >= 0, got inf"),
        (["--loss-weights", "nan"], "error: --loss-weights must be a finite number, got nan"),
        (["--desirable-weight", "-1"], "error: --desirable-weight must be a finite number >= 0"),
        (["--micro-batch-tokens", "auto"], "error: --micro-batch-tokens auto sizes packed micro-"),
        (
            ["--loss", "bradley_terry", "--beta", "0.2"],
            "error: --loss bradley_terry trains a reward model, which computes no log-probs: "
            "--beta does not go with it",
        ),
        (["--loss", "bradley_terry", "--ref", "precompute"], "log-probs: --ref does not go"),
        (["--loss", "bradley_terry", "--loss", "sft"], "log-probs: --loss sft does not go"),
        (
            ["--center-rewards-coefficient", "0.1"],
            "error: --center-rewards-coefficient goes only with --loss bradley_terry",
        ),
    ],
)
def test_invalid_flags_fail_with_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        train_dpo.main(argv)
    err = capsys.readouterr().err
    assert (
        e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err
    ), err


def test_help_says_what_each_group_sets_and_no_default_is_none(capsys, monkeypatch):
    """--help: every group of flags (each sub-config of Config) opens with its own description (the
    comment above its field, which tyro reads), and no flag shows "(default: None)": a default
    decided later is said in its text."""
    monkeypatch.setenv("COLUMNS", "100")  # one column of groups
    with pytest.raises(SystemExit) as e:
        train_dpo.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "(default: None)" not in out
    # Boxes on a terminal, rules of "-" when captured: each group's title, then its first text.
    lines = [line.strip(" │╭╮╰╯─") for line in out.splitlines()]
    described = {
        line.removesuffix(" options"): next(x for x in lines[i + 1 :] if x.strip("-"))
        for i, line in enumerate(lines)
        if line.endswith(" options")
    }
    hints = typing.get_type_hints(train_dpo.Config)
    groups = [name for name, hint in hints.items() if dataclasses.is_dataclass(hint)]
    assert len(groups) == 11 and sorted(described) == sorted(g.replace("_", "-") for g in groups)
    assert all(not text.startswith("-") for text in described.values()), described
    assert len(set(described.values())) == len(groups)  # each its own


def test_two_rank_eval_counts_each_pair_once_and_writes_the_same_samples(two_ranks, tmp_path):
    one, two, err = run(tmp_path, "one", *EVAL_ARGS), str(two_ranks[0]["eval"]), two_ranks[1]
    for out in (one, two):  # one export, whatever the world size, cast tensor by tensor
        exported = load_safetensors(os.path.join(out, "final"))
        assert set(exported) == _hf_export_names() and {t.dtype for t in exported.values()} == {
            torch.bfloat16
        }
    _assert_same_rows(read_metrics(one, "eval"), read_metrics(two, "eval"), PAIR_METRICS)

    def samples(out):
        return [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]

    assert [s["step"] for s in samples(one)] == [0, 0, 0, 2, 2, 2]
    assert [s["prompt"] for s in samples(one)[:3]] == [p["prompt"] for p in demo_pairs("eval")[:3]]
    assert samples(one)[:3] == samples(two)[:3]  # same weights, same seeded draws
    assert "'Review the" in err and "-> '" in err  # one sample shown on the console


# The lr of one step over a whole file. Adam's first step moves each weight by lr x g / (|g| + eps):
# where a gradient is within rounding of 0, anywhere in +-lr, so after it weights agree to lr, and
# the loss and the gradient norm carry the comparison.
K_STEP_LR = 1e-3


def k_step_args(data, rows):
    """One float32 step over the whole file `data` (one batch of `rows` rows) at K_STEP_LR."""
    return (
        *("--data", data, "--eval-data", HELD_OUT, "--batch-size", str(rows)),
        *("--max-steps", "1", "--lr", str(K_STEP_LR), "--warmup-steps", "0"),
    )


def _one_step(tmp_path, name, data, rows, *args):
    return run(tmp_path, name, *k_step_args(data, rows), *args)


def _final_weights(out):
    return load_safetensors(os.path.join(out, "final"))


@pytest.mark.parametrize(
    "flags",
    [
        (),
        (
            "--no-share-prompt",
            "--ref",
            "precompute",
            "--lora-rank",
            "8",
            "--use-weighting",
            "--ld-alpha",
            "0.5",
        ),
    ],
    ids=["shared", "separate-precompute-lora-wpo-ld"],
)
def test_one_step_over_k_rows_equals_one_over_the_same_pairs_as_a_pair_file(
    tmp_path, k_files, flags
):
    """K = 2 to 5 per row, all pairs: the loss, gradient norm and exported weights of one step over
    the whole K-response file equal one step over the same pairs written out as a pair file."""
    k_file, pair_file = k_files
    k = _one_step(tmp_path, "k", k_file, len(K_ROWS), *flags, "--cache-dir", str(tmp_path / "c1"))
    p = _one_step(
        tmp_path, "p", pair_file, len(K_PAIRS), *flags, "--cache-dir", str(tmp_path / "c2")
    )
    (a,), (b,) = read_metrics(k), read_metrics(p)
    # Step 1, from the same weights: only one forward's and backward's rounding in each layout
    # (LOGP_REL), not that of runs whose weights Adam has already moved apart.
    assert a["loss"] == pytest.approx(b["loss"], rel=LOGP_REL)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=LOGP_REL)
    # Each response scored once, not once per pair.
    assert a["flops"] < b["flops"]
    # LoRA exports the adapters alone.
    exported = _adapters if "--lora-rank" in flags else _final_weights
    wa, wb = exported(k), exported(p)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=K_STEP_LR)


def start_packed_ranks(request, folder):
    """Background's start of packed_ranks, two runs on two ranks: "packed", one step over the
    K-response file (k_step_args) packed into micro-batches of at most 600 tokens; "reward":
    REWARD_ARGS on _margin_pairs, packed into micro-batches of at most 400 tokens."""
    k_files = request.getfixturevalue("k_files")
    outs = {"packed": folder / "packed", "reward": folder / "reward"}
    args = (*k_step_args(k_files[0], len(K_ROWS)), "--packing", "--micro-batch-tokens", "600")
    runs = [
        trainer_args(outs["packed"], *args),
        trainer_args(
            outs["reward"],
            *("--data", _margin_pairs(folder)[0], *REWARD_ARGS),
            *("--packing", "--micro-batch-tokens", "400"),
        ),
    ]
    return run_ranks, 2, outs, runs, []


@pytest.fixture(scope="module")
def packed_ranks(background):
    return background.result("packed_ranks")


def test_two_ranks_train_k_rows_as_one(tmp_path, k_files, two_ranks, packed_ranks):
    """One step over the K-response file on two ranks, whose halves hold different numbers of
    pairs (K from 2 to 5), against one rank: the mean is over the global batch's pairs. Packed
    (--packing) too: each rank's share of packed micro-batches, as many on each."""
    one = _one_step(tmp_path, "one", k_files[0], len(K_ROWS))
    for two in (two_ranks[0]["krows"], packed_ranks[0]["packed"]):
        _assert_same_rows(read_metrics(str(two)), read_metrics(one))
        wa, wb = _final_weights(one), _final_weights(str(two))
        for key in wa:
            torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=K_STEP_LR)
    assert read_metrics(str(packed_ranks[0]["packed"]))[0]["padding_efficiency"] == 1.0


GENERATE = os.path.join(HERE, "generate.py")
# The on-policy test's generation flags, on one rank and on two.
ONPOLICY_FLAGS = ("--max-new-tokens", "8", "--batch-size", "2", "--top-p", "0.9")


def onpolicy_args(folder, out):
    """generate.py's flags for round 1 of the on-policy test, from a tiny model, the demo's first 10
    prompts and a scorer module (`scorer:score`, by length), each written once into `folder`: 5
    prompts in 3 batches of 2, so that on two ranks one runs a batch whose rows it drops."""
    model = os.path.join(folder, "onpolicy-start")
    if not os.path.isdir(model):
        tiny_model(tiny_config()[0], seed=0).save_pretrained(model)
        load_tokenizer("tiny").save_pretrained(model)
        prompts = [p["prompt"] for p in demo_pairs("train")[:10]]
        with open(os.path.join(folder, "onpolicy-prompts.jsonl"), "w") as f:
            f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
        os.makedirs(os.path.join(folder, "fake"), exist_ok=True)
        with open(os.path.join(folder, "fake", "scorer.py"), "w") as f:
            f.write("def score(prompt, completion):\n    return float(len(completion) % 7)\n")
    args = ["--model", model, "--data", os.path.join(folder, "onpolicy-prompts.jsonl")]
    args += ["--out", os.path.join(out, "rows.jsonl"), "--seed", "1", "--num-generations", "3"]
    return [*args, "--reward", "scorer:score", "--max-prompts", "5", *ONPOLICY_FLAGS]


def _run_onpolicy(out, env):
    script = os.path.join(HERE, "bench", "onpolicy.sh")
    proc = subprocess.run(["bash", script], cwd=HERE, env=env, capture_output=True, text=True)
    again = subprocess.run(["bash", script], cwd=HERE, env=env, capture_output=True, text=True)
    return out, proc, again


def start_onpolicy(request, folder):
    """Background's "onpolicy": bench/onpolicy.sh's two rounds from onpolicy_args's model,
    prompts and scorer, then the script again. Its value: (the rounds' folder, both runs'
    CompletedProcess)."""
    onpolicy_args(folder, folder / "rows")  # writes the start model, prompts and scorer
    out = folder / "onpolicy"
    env = {
        **SUBPROCESS_ENV,
        "PYTHONPATH": str(folder / "fake"),
        "MODEL": str(folder / "onpolicy-start"),
        "DATA": str(folder / "onpolicy-prompts.jsonl"),
        "OUT": str(out),
        "ROUNDS": "2",
        "PROMPTS": "5",
        "K": "3",
        "REWARD": "scorer:score",
        "PY": sys.executable,
        "GEN_FLAGS": " ".join(ONPOLICY_FLAGS),
        "TRAIN_FLAGS": "--batch-size 2 --lr 1e-3 --num-samples 0 --eval-fraction 0.2",
    }
    return _run_onpolicy, out, env


@pytest.fixture(scope="module")
def onpolicy(background):
    return background.result("onpolicy")


def test_onpolicy_rounds_generate_train_and_export_and_two_ranks_write_the_same_rows(
    two_ranks, onpolicy
):
    """bench/onpolicy.sh, two rounds on the demo's prompts (a random tiny model writes no review,
    so a scorer by length ranks its samples): each round's rows are its slice's prompts with K
    completions of the round's model, scored by the scorer; it trains on them and exports, and
    round 2 starts (model and reference) from round 1's export. Run again, it redoes nothing.
    Round 1 generated on two ranks (two_ranks's "rows") wrote the same rows byte for byte."""
    outs, _ = two_ranks
    out, proc, again = onpolicy
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model = out.parent / "onpolicy-start"
    prompts = [p["prompt"] for p in demo_pairs("train")[:10]]
    start = safetensors.torch.load_file(str(model / "model.safetensors"))
    for r in (1, 2):
        round_dir = out / f"round-{r}"
        rows = [json.loads(line) for line in (round_dir / "rows.jsonl").read_text().splitlines()]
        assert [row["prompt"] for row in rows] == prompts[(r - 1) * 5 : r * 5]
        for row in rows:
            assert len(row["responses"]) == 3
            assert row["scores"] == [float(len(c) % 7) for c in row["responses"]]
        meta = json.loads((round_dir / "rows.jsonl.json").read_text())
        previous = str(model) if r == 1 else str(out / "round-1" / "final")
        assert meta["model"] == previous and meta["seed"] == r and meta["prompts"] == 5
        config = json.loads((round_dir / "final" / "train_config.json").read_text())
        assert config["model"] == previous
        logged = [json.loads(x) for x in (round_dir / "metrics.jsonl").read_text().splitlines()]
        assert any(x.get("split") == "train" and x["step"] == 1 for x in logged)
        assert any(x.get("split") == "eval" for x in logged)
        final = safetensors.torch.load_file(str(round_dir / "final" / "model.safetensors"))
        assert not torch.equal(final["model.norm.weight"], start["model.norm.weight"])
        start = final
    assert again.returncode == 0 and "round 1 of" not in again.stdout, again.stdout
    assert [r["exit"] for r in run_records(outs["rows"], 2)] == [None, None]
    two = (outs["rows"] / "rows.jsonl").read_bytes()
    assert two == (out / "round-1" / "rows.jsonl").read_bytes()


COMPILED = """
import json, os
from unittest import mock
import torch
from torch._dynamo.utils import counters
import train_dpo
inductor, real = torch._dynamo.lookup_backend("inductor"), torch.nn.Module.compile

def backend(graph, example_inputs):
    if torch.is_grad_enabled():  # the grad mode Dynamo traced (and guards) it in
        return inductor(graph, example_inputs)
    return graph.forward

def compile_with(self, *args, **kwargs):
    real(self, *args, **kwargs, backend=backend)

def main(argv):  # patched for this run alone; Dynamo's counters to dynamo.json in its --out-dir
    torch._dynamo.reset()  # no variants or counts from earlier runs of the start
    counters.clear()
    try:
        with (
            mock.patch.object(torch.nn.Module, "compile", compile_with),
            torch._dynamo.config.patch(fail_on_recompile_limit_hit=True),
        ):
            train_dpo.main(argv)
        record = {
            "aot_autograd": counters["aot_autograd"]["ok"],
            "graph_breaks": dict(counters["graph_break"]),
            "unique_graphs": counters["stats"]["unique_graphs"],
        }
        out = argv[argv.index("--out-dir") + 1]
        with open(os.path.join(out, "dynamo.json"), "w") as f:
            json.dump(record, f)
    finally:
        torch._dynamo.reset()
"""
COMPILED_ARGS = ("--max-steps", "3", "--micro-batch-size", "8", "--loss", "simpo")
COMPILED_ARGS += ("--eval-every", "1", "--num-samples", "2", "--sample-max-tokens", "4")


def start_compiled_runs(request, folder):
    """Background's "compiled_runs": in one rank's start, COMPILED_ARGS eager ("eager"), then with
    --activation-checkpointing --compile under COMPILED ("compiled")."""
    (folder / "compiled.py").write_text(COMPILED)
    outs = {"eager": folder / "eager", "compiled": folder / "compiled"}
    compiled = trainer_args(outs["compiled"], *COMPILED_ARGS, "--activation-checkpointing")
    runs = [
        trainer_args(outs["eager"], *COMPILED_ARGS),
        {"argv": [*compiled, "--compile"], "script": str(folder / "compiled.py")},
    ]
    return run_ranks, 1, outs, runs


@pytest.fixture(scope="module")
def compiled_runs(background):
    return background.result("compiled_runs")


def test_compiled_blocks_train_like_eager_with_evaluation_and_samples_under_the_recompile_limit(
    compiled_runs,
):
    """CPU: inductor's C++ kernels; with activation checkpointing, so its recomputation is compiled
    too. SimPO, reference-free: the policy's forward and backward are what inductor compiles; a
    no-grad graph (evaluation's, a reference's) would be as long again to compile on a CPU, and is
    the same blocks' forward: Dynamo's eager backend runs it (COMPILED). Against the same 3 steps
    eager (checkpointing changes no math: tested above), step by step and at each evaluation.

    The recompile limit: past it, Dynamo runs the blocks eager without a word; here it fails the run
    instead. Generation's forwards (a KV cache, one-token queries, a variant per layer index) ran
    compiled code and filled the limit: here samples at each evaluation, between training steps."""
    outs, proc = compiled_runs
    assert_runs_ended(proc, outs.values(), 1)
    eager = str(outs["eager"])
    compiled = str(outs["compiled"])
    counters = json.loads((outs["compiled"] / "dynamo.json").read_text())
    # Dynamo captured the blocks' forward as graphs, and AOT autograd compiled their backward.
    assert counters["aot_autograd"] > 0
    assert not counters["graph_breaks"], counters["graph_breaks"]
    # Training and evaluation, with and without gradients, a first shape static and then dynamic
    # ones: a few variants, under the limit of 8.
    assert 0 < counters["unique_graphs"] <= 5, counters
    rows = [json.loads(line) for line in open(os.path.join(compiled, "samples.jsonl"))]
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3]  # two samples at each evaluation
    _assert_same_rows(read_metrics(compiled), read_metrics(eager), ("loss", "grad_norm", "lr"))
    _assert_same_rows(read_metrics(compiled, "eval"), read_metrics(eager, "eval"), ("loss",))


def kto_step_args(kto_file):
    """One float32 step of --loss kto over the whole unpaired file (one batch of its 20 prompts'
    rows), no evaluation."""
    args = k_step_args(kto_file, 20)
    return (*args[:2], *args[4:], "--loss", "kto")


def test_kto_shares_prompts_exactly_keeps_precompute_and_logs_what_trl_logs(
    tmp_path, kto_file, two_ranks, capsys
):
    """One step of KTO over the unpaired file, a prompt's reviews in one row, against the same on
    two ranks, with the reference's log-probs (the mismatched ones too) precomputed, in a row per
    response: the same loss, gradient norm, KL and weights (a row per response alone:
    test_orpo_and_kto_score_shared_rows_as_separate_ones_and_as_pairs_written_out). The losses
    that take pairs refuse the file."""
    shared = _one_step(tmp_path, "shared", kto_file, 20, "--loss", "kto")
    two = str(two_ranks[0]["kto"])
    (a,) = read_metrics(shared)
    # The policy is the reference: their mismatched log-probs agree bit for bit, and so the KL.
    assert a["loss"] == pytest.approx(0.5, rel=F32_REL) and a["kl"] == 0
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert key in a
    for out in (two,):
        (b,) = read_metrics(out)
        for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
            assert b[key] == pytest.approx(a[key], rel=LOGP_REL), (out, key)
        wa, wb = _final_weights(shared), _final_weights(out)
        for name in wa:
            torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=K_STEP_LR)
    # The held-out pairs after the step: KL, rewards by label, accuracy over each prompt's pairs.
    (e,) = read_metrics(shared, "eval")
    assert e["kl"] >= 0 and {"rewards/accuracies", "rewards/chosen", "rewards/rejected"} <= e.keys()
    with pytest.raises(SystemExit):
        train_dpo.main(trainer_args(tmp_path / "dpo", "--data", kto_file))
    assert "train --loss kto or apo_zero_unpaired, not dpo" in capsys.readouterr().err


def test_orpo_and_cpo_run_no_reference_model(tmp_path, k_files):
    """CPO (--ref none) counts no reference forward: a step's FLOPs are 3 forwards' worth of the
    policy's, against DPO's 4 (ORPO, reference-free too: bench/trl_kto.sh trains it against TRL)."""
    step = ("--data", k_files[1], "--batch-size", "8", "--max-steps", "1")
    dpo = run(tmp_path, "dpo", *step)
    cpo = run(tmp_path, "cpo", *step, "--ref", "none")
    (a,), (b,) = read_metrics(dpo), read_metrics(cpo)
    assert b["flops"] == pytest.approx(a["flops"] * 3 / 4, rel=1e-12)


# ------------------------------------------------------------------------------------ reward models
def _reward_model(pad_id, seed=0):
    """The tiny model as --loss bradley_terry builds it (a sequence classifier, one label, reading
    a text's score at its last token that is not `pad_id`), whole, on the CPU."""
    config, _ = tiny_config()
    config.num_labels = 1
    config.pad_token_id = pad_id
    torch.manual_seed(seed)
    return transformers.AutoModelForSequenceClassification.from_config(config).eval()


def _own_rewards(model, rows):
    """{(row, response): the model's own score of [prompt | response] alone}: its forward, which
    reads the last token that is not padding."""
    with torch.no_grad():
        return {
            (b, k): model(input_ids=torch.tensor([row["prompt"] + response])).logits[0, 0].item()
            for b, row in enumerate(rows)
            for k, response in enumerate(row["responses"])
        }


def test_a_reward_model_scores_each_response_as_its_own_forward_of_prompt_and_response():
    """logps.response_rewards of separate, shared and packed rows (two and three responses, a
    one-token prompt) against the sequence classifier's own forward of each prompt + response alone
    (float32: LOGP_REL of the largest), with padding an id of its own and with padding the EOS
    (transformers then reads the token before it); the Bradley-Terry loss with margins and
    centering by hand; its gradient reaches the head."""
    g = torch.Generator().manual_seed(0)
    eos = load_tokenizer("tiny").eos_token_id

    def ids(n):
        return torch.randint(3, 200, (n,), generator=g).tolist()

    rows = [
        {"prompt": ids(5), "responses": [ids(3) + [eos], ids(6) + [eos]], "scores": [1.0, 0.0]},
        {"prompt": ids(1), "responses": [ids(2) + [eos], ids(4) + [eos]], "scores": [0.0, 1.0]},
        {
            "prompt": ids(4),
            "responses": [ids(1) + [eos], ids(5) + [eos], ids(2) + [eos]],
            "scores": [2.0, 0.0, 1.0],
        },
    ]
    rows[0]["margin"] = 0.5
    for pad in (0, eos):
        model = _reward_model(pad)
        own = _own_rewards(model, rows)
        for share, packing in itertools.product((False, True), repeat=2):
            batch = batches.collate_rows(rows, pad, share, packing=packing)
            got = logps.response_rewards(model, batch)
            expected = torch.tensor(
                [
                    own[b, k]
                    for b, k in zip(batch.response_rows.tolist(), batch.response_columns.tolist())
                ]
            )
            scale = expected.abs().max().item()
            torch.testing.assert_close(got, expected, rtol=0, atol=LOGP_REL * scale)
    # The last batch's pairs: [chosen; rejected] rewards, a margin on the first row's pair alone.
    pairs = batch.pair_sides(got).detach().tolist()
    chosen, rejected = pairs[: len(pairs) // 2], pairs[len(pairs) // 2 :]
    margins = [0.5 if b == 0 else 0.0 for b in batch.response_rows[batch.chosen_index].tolist()]
    assert batch.margins.tolist() == margins and len(margins) == 1 + 1 + 3
    out = loss.reward_losses(batch.pair_sides(got), batch.margins, 0.01)
    hand = [
        math.log1p(math.exp(-(c - r - m))) + 0.01 * (c + r) ** 2
        for c, r, m in zip(chosen, rejected, margins)
    ]
    assert out.losses.tolist() == pytest.approx(hand, rel=F32_REL)
    assert out.chosen_rewards.tolist() == chosen and out.chosen_logps.isnan().all()
    out.losses.sum().backward()
    assert model.score.weight.grad.abs().sum() > 0


def test_a_causal_lm_read_as_a_reward_model_keeps_its_blocks_and_gets_a_new_scalar_head(tmp_path):
    """models.open_weights of a causal LM's folder (its output layer untied) under a one-label
    config: every weight the classifier has, the causal LM's own under the same names, and a new
    (1, H) head drawn from the seed at transformers' scale (std initializer_range), the same for
    the same seed."""
    config, tokenizer = tiny_config()
    causal = tiny_model(config, seed=0)
    causal.config.tie_word_embeddings = False
    causal.lm_head.weight = torch.nn.Parameter(causal.lm_head.weight.detach().clone())
    causal.save_pretrained(tmp_path / "causal")
    config.num_labels = 1
    heads = []
    for seed in (3, 3, 4):
        weights = models.open_weights(str(tmp_path / "causal"), config, seed)
        assert set(_reward_model(0).state_dict()) <= set(weights)
        for name, tensor in causal.state_dict().items():
            if name != "lm_head.weight":
                assert torch.equal(weights[name], tensor), name
        heads.append(weights["score.weight"])
    assert heads[0].shape == (1, config.hidden_size) and torch.equal(heads[0], heads[1])
    assert not torch.equal(heads[0], heads[2])
    assert torch.cat(heads).std().item() == pytest.approx(config.initializer_range, rel=0.2)


# 3 float32 steps of a reward model on 16 pairs with margins, centered.
REWARD_ARGS = (
    "--loss",
    "bradley_terry",
    "--center-rewards-coefficient",
    "0.01",
    "--max-steps",
    "3",
    "--micro-batch-size",
    "4",
    "--eval-data",
    HELD_OUT,
)


def _reward_rows(pairs, tokenizer):
    """The pairs' ids as a run tokenizes them (at its default lengths), as rows of two
    responses."""
    config = DataConfig()
    tokens = tokenize(pairs, tokenizer, config.max_length, config.prompt_limit)
    return [{"prompt": t["prompt"], "responses": [t["chosen"], t["rejected"]]} for t in tokens]


def _margin_pairs(folder):
    """The demo's first 16 pairs, each with TRL's "margin" field: 0, 0.25, 0.5, 0.75 in turn."""
    pairs = [{**p, "margin": 0.25 * (i % 4)} for i, p in enumerate(demo_pairs("train")[:16])]
    return write_jsonl(str(folder / "margins.jsonl"), pairs), pairs


def test_a_reward_model_trains_on_its_own_forwards_loss_resumes_exactly_and_exports_a_classifier(
    tmp_path, packed_ranks
):
    """--loss bradley_terry, 3 steps of all 16 pairs (so step 1 is every pair): step 1's loss,
    accuracy and highest and lowest reward are the initial classifier's own forwards' (by hand,
    TRL's formula with margins and centering); two ranks with packed rows train alike
    (packed_ranks' "reward"); a resume from step 2 is bit for bit; final/ loads with
    AutoModelForSequenceClassification (one label, the pad token set) and its own forwards give the
    held-out margin training logged; generate.py's scorer reads it so. With LoRA (one step) the
    adapters and the whole head train, and the export is the merged classifier."""
    data_file, pairs = _margin_pairs(tmp_path)
    args = ("--data", data_file, *REWARD_ARGS)
    out = run(tmp_path, "rm", *args, "--save-every", "2")
    tokenizer = load_tokenizer("tiny")
    start = _reward_model(tokenizer.pad_token_id)
    rows = _reward_rows(pairs, tokenizer)
    own = _own_rewards(start, rows)
    chosen = [own[b, 0] for b in range(len(rows))]
    rejected = [own[b, 1] for b in range(len(rows))]
    hand = [
        math.log1p(math.exp(-(c - r - p["margin"]))) + 0.01 * (c + r) ** 2
        for c, r, p in zip(chosen, rejected, pairs)
    ]
    first = read_metrics(out)[0]
    assert first["loss"] == pytest.approx(sum(hand) / len(hand), rel=RUN_REL)
    assert first["rewards/accuracies"] == sum(c > r for c, r in zip(chosen, rejected)) / 16
    assert first["rewards/max"] == pytest.approx(max(chosen + rejected), rel=RUN_REL)
    assert first["rewards/min"] == pytest.approx(min(chosen + rejected), rel=RUN_REL)
    assert first["rewards/mean"] == pytest.approx(sum(chosen + rejected) / 32, abs=LOGP_REL)
    assert "logps/chosen" not in first
    two = str(packed_ranks[0]["reward"])
    _assert_same_rows(read_metrics(two), read_metrics(out), ("loss", "grad_norm"))
    wa, wb = _final_weights(two), _final_weights(out)
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=ADAM_ATOL)
    step_2 = os.path.join(out, "checkpoints", "step-2")
    resumed = run(tmp_path, "resumed", *args, "--resume", step_2)
    keys = ("loss", "grad_norm", "lr", "rewards/margins", "rewards/max", "rewards/min")
    _assert_same_rows(read_metrics(resumed), read_metrics(out)[2:], keys, exact=True)
    wa, wb = _final_weights(resumed), _final_weights(out)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    final = os.path.join(out, "final")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(final).eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    held = _reward_rows(HELD_OUT_PAIRS, tokenizer)
    scores = _own_rewards(model, held)
    margins = [scores[b, 0] - scores[b, 1] for b in range(len(held))]
    logged = read_metrics(out, "eval")[-1]
    scale = max(map(abs, scores.values()))
    assert logged["rewards/margins"] == pytest.approx(sum(margins) / 16, abs=LOGP_REL * scale)
    with world_of_one():
        scorer = generate.load_scorer(final, CPU, torch.float32)
        pair = HELD_OUT_PAIRS[0]
        got = scorer([pair["prompt"]] * 2, [pair["chosen"], pair["rejected"]])
    assert got == pytest.approx([scores[0, 0], scores[0, 1]], abs=LOGP_REL * scale)
    lora = run(tmp_path, "lora", *args, "--max-steps", "1", "--lora-rank", "4")
    final = os.path.join(lora, "final")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(final)
    assert not torch.equal(model.score.weight, start.score.weight)
    assert not os.path.exists(os.path.join(final, "adapter_config.json"))


def start_stalled(request, folder):
    """Background's start of stalled: two ranks (processes without torchrun) on the demo's data,
    --collective-timeout 3; bench/stall.py stops rank 1 (SIGSTOP) at its second step, after
    writing when into its --out-dir."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**SUBPROCESS_ENV, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    env |= {"MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    argv = trainer_args(folder, "--max-steps", "4", "--micro-batch-size", "4")
    argv += ["--collective-timeout", "3"]
    return (
        _run_stalled,
        folder,
        [sys.executable, os.path.join(HERE, "bench", "stall.py"), *argv],
        env,
    )


def _run_stalled(folder, cmd, env):
    """(rank 0's exit code, its stderr, seconds from the stall to its end, the run's folder)."""
    procs = [
        subprocess.Popen(
            cmd,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        _, err = procs[0].communicate(timeout=200)
        ended = time.time()
    finally:
        procs[1].kill()  # a stopped process ends on SIGKILL
        procs[1].communicate()
    stalled = folder / "stalled"
    waited = ended - float(stalled.read_text()) if stalled.exists() else None
    return procs[0].returncode, err, waited, folder


@pytest.fixture(scope="module")
def stalled(background):
    return background.result("stalled")


def test_a_rank_that_stops_answering_ends_the_job_after_the_collective_timeout(stalled):
    """Two ranks, --collective-timeout 3: rank 1 stops at step 2; rank 0 ends the job 3 s later
    (not after start-up's 30 minutes) with one line naming rank 1, and exit code 1. Step 1, whose
    start-up kept the long timeout, was logged."""
    code, err, waited, out = stalled
    assert code == 1, err
    (line,) = [x for x in err.split("\n") if x.startswith("error:")]
    assert line.startswith(
        "error: rank 0: rank 1 stopped answering: a collective waited --collective-timeout 3 s ("
    )
    assert line.endswith("); --resume latest resumes from the last checkpoint")
    # Rank 0 may start its wait a moment before rank 1 writes the time it stops.
    assert 2 < waited < 20, waited
    assert [r["step"] for r in read_metrics(out)] == [1]


# -------------------------------------------------------------------------------------- the project
# Project-wide checks: house style, and each concern file copied alone runs its examples.


CONCERN_FILES = [
    # Run alone in one process, in this order: those that need the standard library alone first
    # (before torch is imported at all), then torch's, then transformers'; memory.py before
    # fsdp_setup.py has imported torch's FSDP for it.
    "schedule.py",
    "demo.py",
    "memory.py",
    "loss.py",
    "logps.py",
    "precision.py",
    "fsdp_setup.py",
    "checkpoint.py",
    "metrics.py",
    "lora.py",
    "batches.py",
    "data.py",
    "generate.py",
    "models.py",
]
# What a file may import besides its stated packages: none but extras imported where used, which
# its example does not reach. Stated: "the standard library", "torch", "transformers".
_EXTRAS = {"tyro", "docstring_parser", "safetensors", "datasets", "matplotlib", "wandb", "peft"}


def _stated_packages(module_doc: str) -> set:
    """The packages a concern file's docstring says it imports (its "Copyable on its own" line)."""
    said = " ".join(module_doc.split("Copyable on its own")[1].split(".")[0].split())
    return {name for name in ("torch", "transformers") if name in said}


def test_concern_files_import_only_stdlib_and_torch():
    siblings = {f[:-3] for f in CONCERN_FILES} | {"train_dpo"}
    for name in CONCERN_FILES:
        source = open(os.path.join(HERE, name)).read()
        tree = ast.parse(source)
        stated = _stated_packages(ast.get_docstring(tree))
        lazy = {n for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for n in ast.walk(f)}
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module]
            for mod in mods:
                top = mod.split(".")[0]
                assert top not in siblings, f"{name} imports its sibling {mod}"
                allowed = (
                    top in stated
                    or top in sys.stdlib_module_names
                    or (node in lazy and top in ("datasets", "matplotlib", "wandb", "peft"))
                    # generate.py's command line parses its flags as train_dpo.py's are parsed.
                    or (name == "generate.py" and node in lazy and top == "tyro")
                )
                assert allowed, f"{name} imports {mod}"


# Run in a process of its own: each concern file alone in a folder of its own (no sibling
# reachable), imported, then its docstring's example run as written; for a file that needs the
# standard library or torch alone, no other package can be imported meanwhile.
_EXAMPLES = r"""
import importlib, importlib.abc, sys, textwrap

class Refuse(importlib.abc.MetaPathFinder):
    blocked = set()

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.blocked:
            raise ImportError(f"{fullname}: not among the packages its docstring states")

refuse = Refuse()
sys.meta_path.insert(0, refuse)
for name, blocked in FILES:
    refuse.blocked = set(blocked)
    sys.path.insert(0, name)
    module = importlib.import_module(name)
    text = module.__doc__.split("This runs as written")[1].split(":\n\n", 1)[1]
    block = []
    for line in text.splitlines():
        if line and not line.startswith("    "):
            break
        block.append(line)
    print(f"== {name}", flush=True)
    exec(textwrap.dedent("\n".join(block)), {"__name__": "__example__"})
    sys.path.pop(0)
    for other, _ in FILES:
        sys.modules.pop(other, None)
"""


def _import_each(folder, script):
    cmd = [sys.executable, "-c", script]
    return subprocess.run(
        cmd, cwd=folder, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=180
    )


def start_imports(request, folder):
    """Background's "imports": _EXAMPLES over every concern file."""
    files = []
    for f in CONCERN_FILES:
        (folder / f[:-3]).mkdir()
        source = open(os.path.join(HERE, f)).read()
        (folder / f[:-3] / f).write_text(source)
        stated = _stated_packages(ast.get_docstring(ast.parse(source)))
        blocked = _EXTRAS | {"torch", "transformers"} - stated
        # transformers imports (or probes for) some of the extras itself: a file that states it is
        # checked by its import statements alone (test_concern_files_import_only_stdlib_and_torch).
        files.append((f[:-3], sorted(blocked) if "transformers" not in stated else []))
    return _import_each, folder, f"FILES = {files!r}\n" + _EXAMPLES


@pytest.fixture(scope="module")
def imports(background):
    return background.result("imports")


def test_each_concern_file_copied_alone_runs_its_docstring_example(imports):
    assert imports.returncode == 0, imports.stdout[-2000:] + imports.stderr[-3000:]
    ran = [line[3:] for line in imports.stdout.splitlines() if line.startswith("== ")]
    assert ran == [f[:-3] for f in CONCERN_FILES]
    # memory.py's: the example's table, then the largest micro-batch of the three that fits.
    shown = imports.stdout.split("== memory\n")[1].split("== ")[0]
    assert "memory plan:" in shown and "peak at micro-batch 4" in shown
    assert shown.splitlines()[-1] == "4", shown


def _end_of_line_comments_and_code_lines(source: str) -> tuple[int, int]:
    """(comments after code on their line, lines holding code): docstrings and blank or
    comment-only lines are not code."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docstrings.update(range(node.lineno, node.end_lineno + 1))
    comments = 0
    code = set()
    skip = (
        pytokenize.NL,
        pytokenize.NEWLINE,
        pytokenize.INDENT,
        pytokenize.DEDENT,
        pytokenize.ENDMARKER,
    )
    for token in pytokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == pytokenize.COMMENT and token.line[: token.start[1]].strip():
            comments += 1
        elif token.type not in skip and token.type != pytokenize.COMMENT:
            code.update(set(range(token.start[0], token.end[0] + 1)) - docstrings)
    return comments, len(code)


def test_house_style_that_the_linter_does_not_check():
    """ruff (in .ci/run) checks the layout, line length and lambdas assigned to plain names; this
    checks the rest of the house style. Size counts Python AST statements, as DEVELOPERS.md says:
    blank lines, comments, docstrings (a string alone as a statement: a module's, class's,
    function's or field's) and the formatter's line breaks are free; train_dpo.py at most 384, all
    non-test code at most 3,180 (the project's goal is 280 and 2,950, +100 with packing, +40 with
    the faults' handling, +90 with reward models). At most 5 end-of-line
    comments per 100 code lines in every file; no lambda assigned to a name or attribute, no
    nested conditional expression, no issue numbers in code; code that runs patches nothing
    (unittest.mock) and uses tyro's public API alone."""
    files = [f for f in os.listdir(HERE) if f.endswith(".py")]
    statements = {}
    for name in files:
        source = open(os.path.join(HERE, name)).read()
        tree = ast.parse(source)
        statements[name] = sum(
            isinstance(n, ast.stmt)
            and not (isinstance(n, ast.Expr) and isinstance(getattr(n.value, "value", None), str))
            for n in ast.walk(tree)
        )
        comments, code = _end_of_line_comments_and_code_lines(source)
        assert comments <= 0.05 * code, (
            f"{name}: {comments} end-of-line comments, {code} code lines"
        )
        assert name == "test_dpo.py" or not re.search(r"\b[Ii]ssues? \d+", source), name
        # Code that runs patches nothing and uses tyro's public API alone.
        assert name == "test_dpo.py" or not re.search(r"unittest|\btyro\._", source), name
        for node in ast.walk(tree):
            if isinstance(node, ast.IfExp):
                inner = [n for n in ast.walk(node) if isinstance(n, ast.IfExp) and n is not node]
                assert not inner, f"{name}:{node.lineno}: a nested conditional expression"
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                assert not isinstance(node.value, ast.Lambda), f"{name}:{node.lineno}: a lambda"
    del statements["test_dpo.py"]
    assert statements["train_dpo.py"] <= 384, statements
    assert sum(statements.values()) <= 3180, statements
