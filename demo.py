"""The built-in demo task: synthetic product reviews with a known right answer, and its ground-truth
scorer.

Copyable on its own: imports only the standard library.

    pairs = demo_pairs("train")  # 2048 {"prompt", "chosen", "rejected"}, the same on every machine
    score_completion(" The red kettle is great and works well. 5/5")  # +1: the chosen style
    # {"train", "eval", "sft"}: JSON Lines files, written once
    files = demo_files("runs/cache", write_jsonl)
    # the config naming those files, and True
    dataset, demo = demo_config(data.DataConfig(), write_jsonl)
    # the default run's Stages: its first line, the flags DPO from the SFT stage adds, the SFT
    # stage's flags (None once cached)
    stages = warm_start(True, "tiny", ("demo",), True, "runs/cache")

Chosen answers praise the product and end "5/5"; rejected answers pan it and end "1/5". The held-out
split reviews products never seen in training, so a policy must learn the style, not memorise items.
This runs as written:

    import json
    import tempfile

    from demo import demo_files, demo_pairs, score_completion, warm_start

    pairs = demo_pairs("train")
    print(len(pairs), repr(pairs[0]["prompt"]), "->", repr(pairs[0]["chosen"]))
    print(score_completion(pairs[0]["chosen"]), score_completion(pairs[0]["rejected"]))  # 1 -1


    def write_jsonl(path, rows):  # the trainer passes data.write_jsonl
        with open(path, "w") as f:
            for row in rows:
                print(json.dumps(row), file=f)
        return path


    print(sorted(demo_files(tempfile.mkdtemp(), write_jsonl)))
    print(warm_start(True, "tiny", ("demo",), True, tempfile.mkdtemp()).line)
"""

import os
import random
import re
from dataclasses import dataclass, replace

_ADJECTIVES = [
    "red",
    "blue",
    "green",
    "old",
    "new",
    "small",
    "big",
    "cheap",
    "shiny",
    "wooden",
    "steel",
    "plastic",
    "heavy",
    "light",
    "quiet",
    "loud",
]
_TRAIN_NOUNS = [
    "kettle",
    "lamp",
    "chair",
    "phone",
    "watch",
    "bike",
    "drill",
    "tent",
    "radio",
    "camera",
    "blender",
    "toaster",
    "jacket",
    "backpack",
    "mug",
    "pillow",
    "desk",
    "fan",
    "heater",
    "scarf",
]
_EVAL_NOUNS = ["guitar", "helmet", "sofa", "stove", "wallet", "printer"]  # never seen in training
_GOOD = ["great", "superb", "lovely", "excellent", "wonderful"]
_GOOD_WHY = ["works well", "feels solid", "looks nice", "is worth it"]
_BAD = ["bad", "awful", "poor", "terrible", "useless"]
_BAD_WHY = ["broke fast", "feels cheap", "looks ugly", "is a waste"]
_WORD = re.compile(r"[a-z]+|[15]/5")


def demo_pairs(split: str) -> list[dict[str, str]]:
    """2048 "train" or 256 "eval" {"prompt", "chosen", "rejected"} pairs, the same on every machine.
    "sft" is the train split with a coin flip deciding which review is "chosen": SFT on it gives a
    model that writes both styles, as a base model would, which DPO on "train" then moves toward
    praise."""
    rng = random.Random(f"demo-{split}")
    nouns, n = (_EVAL_NOUNS, 256) if split == "eval" else (_TRAIN_NOUNS, 2048)
    pairs = []
    for _ in range(n):
        item = f"{rng.choice(_ADJECTIVES)} {rng.choice(nouns)}"
        good = f" The {item} is {rng.choice(_GOOD)} and {rng.choice(_GOOD_WHY)}. 5/5"
        bad = f" The {item} is {rng.choice(_BAD)} and {rng.choice(_BAD_WHY)}. 1/5"
        if split == "sft" and rng.random() < 0.5:
            good, bad = bad, good
        pairs.append({"prompt": f"Review the {item}:", "chosen": good, "rejected": bad})
    return pairs


def demo_unpaired() -> list[dict]:
    """The "train" split's reviews as thumbs up or down, with no pairing: each pair keeps one of its
    two reviews, a coin flip deciding which; praise is labelled true, criticism false."""
    pairs = demo_pairs("train")
    rng = random.Random("demo-kto")
    sides = [rng.choice(("chosen", "rejected")) for _ in pairs]
    return [
        {"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
        for pair, side in zip(pairs, sides)
    ]


def score_completion(text: str) -> int:
    """The demo's ground truth for a generated review: +1 in the chosen style (praise or "5/5", no
    criticism), -1 in the rejected style (criticism or "1/5", no praise), 0 for neither or both."""
    words = set(_WORD.findall(text.lower()))
    return int(bool(words & {*_GOOD, "5/5"})) - int(bool(words & {*_BAD, "1/5"}))


def score_response(prompt: str, completion: str) -> float:
    """score_completion as generate.py's --reward demo calls it: (prompt, completion) -> score."""
    return float(score_completion(completion))


def demo_files(folder: str, write_jsonl) -> dict[str, str]:
    """{split: path} of the demo's "train", "eval" and "sft" splits and its unpaired "kto" rows
    (demo_unpaired) as JSON Lines files in `folder`, each written by write_jsonl(path, rows)
    unless it is there already."""
    files = {
        split: os.path.join(folder, f"demo-{split}.jsonl")
        for split in ("train", "eval", "sft", "kto")
    }
    for split, path in files.items():
        if not os.path.exists(path):
            write_jsonl(path, demo_unpaired() if split == "kto" else demo_pairs(split))
    return files


@dataclass
class Stages:
    """The built-in default's two stages, as train_dpo.py's main() runs them: the run's first line,
    the flags that DPO from the SFT stage's export adds (before the run's own, which win), and the
    SFT stage's flags (None once its export is in the cache; they resume the stage's own checkpoint
    where a stopped stage saved one), with what a stopped stage says."""

    line: str
    dpo_flags: list[str]
    sft_flags: list[str] | None = None
    resume_hint: str = "run the same command again: the demo's SFT stage goes on from there"


def warm_start(
    enabled: bool, model: str, data: tuple, pairwise: bool, cache_dir: str
) -> Stages | None:
    """The built-in default's Stages, when `enabled`, with the SFT stage's export in `cache_dir`;
    None for any other run (a --model, a --data, an SFT run). A model trained from random bytes by
    DPO alone writes gibberish; the SFT stage (SFT on "sft", the coin-flip split) writes both styles
    of review, as a base model would, and DPO from it visibly moves its samples toward the chosen
    style."""
    if not enabled or model != "tiny" or data not in ((), ("demo",), ("demo:kto",)) or not pairwise:
        return None
    folder = os.path.join(cache_dir, "demo-sft")
    export = os.path.join(folder, "final")
    stages = Stages(
        f"demo: DPO from its SFT stage's model, {folder}/final (trained once)",
        [
            *("--model", export, "--lr", "3e-5", "--beta", "0.5", "--eval-every", "16"),
            *("--num-samples", "32", "--sample-temperature", "1"),
            # demo:kto's reviews share few prompts, a row each: 7 epochs take about the DPO demo's
            # 64 steps.
            *(("--epochs", "7") if data == ("demo:kto",) else ()),
        ],
    )
    if os.path.isdir(export):
        return stages
    stages.sft_flags = [
        *("--loss", "sft", "--data", "demo:sft", "--epochs", "6", "--out-dir", folder),
        *("--cache-dir", cache_dir, "--num-samples", "0", "--no-eval-before"),
    ]
    stages.line = f"demo: training its SFT stage first (once, cached in {folder}), then DPO"
    # A stage stopped by a signal saved a checkpoint: the next run goes on from it.
    if os.path.exists(os.path.join(folder, "checkpoints", "latest")):
        stages.sft_flags += ["--resume", "latest"]
        stages.line = f"demo: its SFT stage goes on from its checkpoint in {folder}, then DPO"
    return stages


def record_samples(evaluations: list | None, step: int, means: dict, samples: list[dict]) -> None:
    """An evaluation's samples by the demo's ground truth: their shares in the chosen and in the
    rejected style added to `means`, and (step, preferred share, first sample) to `evaluations`
    (what_moved reads them); nothing for other data (None) or without samples."""
    if evaluations is None or not samples:
        return
    scores = [score_completion(s["completion"]) for s in samples]
    means.update(
        {
            "samples/preferred": scores.count(1) / len(scores),
            "samples/rejected_style": scores.count(-1) / len(scores),
        }
    )
    evaluations.append((step, means["samples/preferred"], samples[0]))


def what_moved(evaluations: list[tuple[int, float, dict]]) -> str:
    """The demo's last line, from its evaluations' (step, preferred share, first sample): the
    scorer's share at the first, the last and the best evaluation (the first of equals), and the
    first held-out prompt's completion at the first and the last."""
    first = evaluations[0]
    last = evaluations[-1]
    best = max(evaluations, key=lambda evaluation: evaluation[1])
    return (
        f"demo: the scorer prefers {first[1]:.0%} of samples at step {first[0]} and "
        f"{last[1]:.0%} at step {last[0]} (best {best[1]:.0%}, at step {best[0]}); "
        f"{first[2]['prompt']!r} -> {first[2]['completion']!r}, then -> {last[2]['completion']!r}"
    )


def demo_config(dataset, write_jsonl) -> tuple:
    """(config, is the demo) for a data.DataConfig: one that names data comes back as it is, with
    False; the demo's (no --data, demo, demo:sft or demo:kto) comes back naming the demo's files in
    its cache_dir, written there once, with True."""
    if dataset.data not in ((), ("demo",), ("demo:sft",), ("demo:kto",)):
        return dataset, False
    files = demo_files(dataset.cache_dir, write_jsonl)
    evals = dataset.eval_data or (() if dataset.eval_fraction else (files["eval"],))
    split = {("demo:sft",): "sft", ("demo:kto",): "kto"}.get(dataset.data, "train")
    return replace(dataset, data=(files[split],), eval_data=evals), True
