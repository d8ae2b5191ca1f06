"""Preference data: read pairs, or K scored responses per prompt, in the common shapes and tokenize
them as the model sees them, once per run. Copyable on its own: imports only the standard library,
torch and transformers. Row shapes: docs/data.md. This runs as written:

    import os
    import tempfile

    from data import DataConfig, load_tokenizer, load_tokens, tokenize_to_cache, write_jsonl

    folder = tempfile.mkdtemp()
    # K scored responses per prompt, higher better, whose pairs --pairs draws; and plain pairs.
    scored = write_jsonl(
        os.path.join(folder, "scored.jsonl"),
        [{"prompt": "Hi!", "responses": [" Hello!", " Hey.", " Go away."], "scores": [2, 1, 0]}],
    )
    pairs = write_jsonl(
        os.path.join(folder, "pairs.jsonl"),
        [
            {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"},
            {"prompt": "1 + 1 =", "chosen": " 2", "rejected": " 11"},
            {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Lyon."},
        ],
    )
    tokenizer = load_tokenizer("tiny")  # ByT5's bytes, no files; or a hub id or folder
    cache_dir = os.path.join(folder, "cache")
    config = DataConfig(data=(scored, pairs), eval_fraction=0.25, cache_dir=cache_dir)
    path = tokenize_to_cache(config, tokenizer)  # once: a run with the same inputs reuses it
    train, evals, summary = load_tokens(path)  # (read_rows(scored): the checked rows alone)
    row = train[0]  # {"prompt", "responses", "scores"}: ids, each response ending with EOS
    print(tokenizer.decode(row["prompt"]), [tokenizer.decode(r) for r in row["responses"]])
    print(len(train), len(evals), summary["train"]["pairs"])  # the pairs each --pairs draws

Inspect what will be trained:

    python data.py prefs.jsonl --model Qwen/Qwen2.5-0.5B-Instruct --show 3
"""

import argparse
import hashlib
import itertools
import json
import math
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import transformers

_CACHE_VERSION = 7  # bump when tokenization changes, so old caches are not reused
_HH_MARKER = "\n\nAssistant:"
_CHUNK = 2048  # rows per tokenizer call: batched calls are faster
# What a JSON value is, by the type it decodes to, for error messages.
_JSON_KINDS = {
    dict: "an object",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}
# Rows of K scored responses, by the field holding them: (prompt field, responses field, each
# response's key in its item (None: the responses are the items), scores field or key, the sign that
# makes higher better, whether string prompts and responses are a user's request and a chat model's
# answers, rendered by the chat template). The first whose fields a row has wins.
_K_SHAPES = (
    # TRL's unpaired rows, once _read_unpaired has made them rows of one response, scored 1 or 0.
    ("prompt", "completion", None, "label", 1, False),
    ("prompt", "responses", None, "scores", 1, False),
    # RLHFlow's online-RLHF: prompts already rendered by the chat template.
    ("prompt", "responses", None, "rewards", 1, False),
    # princeton-nlp/llama3-ultrafeedback-armorm: its chosen and rejected are chats; so are these.
    ("prompt", "all_generated_responses", None, "all_rm_scores", 1, True),
    ("instruction", "completions", "response", "overall_score", 1, True),  # openbmb/UltraFeedback
    # berkeley-nest/Nectar: rank 1 is the best; prompts are Anthropic HH text, the template given.
    ("prompt", "answers", "answer", "rank", -1, False),
)
# Why rows are dropped, by their count in tokenize_rows' summary, for the error when none is left.
_DROPPED = {
    "dropped_unscored": "with a score missing or not a finite number",
    "dropped_tied": "whose scores are all equal (--missing-eos-penalty included)",
    "dropped_empty": "with fewer than two scores left once empty responses go",
    "dropped_identical": "whose responses were identical token for token",
    "identical_after_truncation": "of these only once cut to --max-length {max_length}, the prompt "
    "to at most {prompt_limit} tokens (--max-prompt-length): raise --max-length, or lower "
    "--max-prompt-length to leave the responses more room",
}
# The chat templates --chat-template names, for tokenizers without one (base models).
_CHAT_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
}


@dataclass
class DataConfig:
    data: tuple[str, ...] = ()
    """Training rows: preference pairs, or K scored responses per prompt (generate.py's on-policy
    rows are these), in .jsonl/.json files, hub:NAME[:SPLIT] or hub:NAME:CONFIG:SPLIT (needs the
    datasets package); docs/data.md lists the shapes. Default: the built-in demo (demo:sft: its
    reviews with coin-flip labels, for an SFT stage). Repeat the flag or separate with commas."""
    eval_data: tuple[str, ...] = ()
    """Held-out rows, the same shapes and forms. Default: the demo's held-out split with the demo,
    else --eval-fraction."""
    eval_fraction: float = 0.0
    """Share of --data held out for evaluation (a fixed, seed-independent choice); 0 with no
    --eval-data: none."""
    max_length: int = 512
    """Most tokens in prompt plus response; longer pairs are truncated."""
    max_prompt_length: int | None = None
    """Most prompt tokens kept when a pair is longer than --max-length. Default: half of
    --max-length."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the score of each response cut short (a row's "cut": generate.py marks the
    completions that --max-new-tokens stopped) before pairs are drawn, as TRL's
    missing_eos_penalty; such a response never gets an EOS appended either way."""
    truncation: Literal["keep_end", "keep_start"] = "keep_end"
    """Which part of a too-long prompt is kept: its end (nearest the response) or its start. A
    leading BOS stays."""
    cache_dir: str = "runs/cache"
    """Tokenized data and --ref precompute log-probs, reused by runs with the same inputs; all ranks
    must share it."""
    chat_template: str | None = None
    """A Jinja chat template file, or the name of one the project ships: chatml. For tokenizers
    without one (base models); it replaces the tokenizer's own, and the export's tokenizer keeps
    it. Default: the tokenizer's own."""

    def __post_init__(self):
        self.data = tuple(s for spec in self.data for s in spec.split(",") if s)
        self.eval_data = tuple(s for spec in self.eval_data for s in spec.split(",") if s)
        if not 0 < self.prompt_limit < self.max_length:
            raise ValueError(
                f"need 0 < --max-prompt-length ({self.prompt_limit}) < --max-length "
                f"({self.max_length}), so every response keeps at least one token"
            )
        if not 0 <= self.missing_eos_penalty < math.inf:
            raise ValueError(
                "--missing-eos-penalty must be a finite number >= 0, got "
                f"{self.missing_eos_penalty}"
            )
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        if self.eval_fraction and self.eval_data:
            raise ValueError("give --eval-data or --eval-fraction, not both")

    @property
    def prompt_limit(self) -> int:
        """--max-prompt-length, or half of --max-length (not stored: the CLI's default instance must
        not pin it)."""
        return self.max_length // 2 if self.max_prompt_length is None else self.max_prompt_length


class DataError(ValueError):
    """Bad input data; the message names the file, line (or row) and field."""


def read_rows(spec: str) -> list[dict]:
    """Checked rows of a file or hub dataset: {"prompt" (None if implicit), "responses", "scores"
    (floats; NaN for a missing or non-finite one), "cut" (a bool per response: cut short by a
    length limit, so it gets no EOS), "fields" (the responses' fields, for errors), "where"}. A
    pair is the responses [chosen, rejected], scored [1, 0]."""
    # The first row's (where, kind): every row must be of its kind.
    rows, first = [], None
    for where, row in _read_source(spec):
        if not isinstance(row, dict):
            raise DataError(
                f"{where}: expected an object with fields chosen, rejected (and prompt); got "
                f"{type(row).__name__}"
            )
        if "chosen" not in row and ("completion" in row or "label" in row):
            read = _read_unpaired
        elif _k_shape(row):
            read = _read_scored
        else:
            read = _read_pair
        prompt, responses, scores, fields, kind = read(row, where)
        first = first or (where, kind)
        if kind != first[1]:
            raise DataError(
                f"{where}: this row is {kind}, but the first row ({first[0]}) is {first[1]}; mixed "
                "formats in one file are refused"
            )
        # TRL's reward-model margin of a pair: r_chosen - r_rejected must pass it (--loss
        # bradley_terry); 0 where absent.
        margin = row.get("margin", 0.0)
        if type(margin) not in (int, float) or not math.isfinite(margin):
            raise DataError(f"{where}: field 'margin' must be a finite number, got {margin!r:.80}")
        # Responses that a length limit cut short, before their end: they get no EOS.
        cut = row.get("cut", [False] * len(responses))
        if not (
            isinstance(cut, list)
            and len(cut) == len(responses)
            and all(isinstance(c, bool) for c in cut)
        ):
            raise DataError(
                f"{where}: field 'cut' must be a list of {len(responses)} booleans, one per "
                f"response (true: cut short, without its end), got {json.dumps(cut)[:80]}"
            )
        rows.append(
            {
                "prompt": prompt,
                "responses": responses,
                "scores": scores,
                "cut": cut,
                "fields": fields,
                "where": where,
                "margin": float(margin),
            }
        )
    if not rows:
        raise DataError(f"{spec}:1: no preference pairs")
    return _by_prompt(rows, spec) if first[1].endswith("'label'") else rows


def _read_pair(row: dict, where: str) -> tuple:
    """(prompt, responses, scores, the responses' fields, kind) of a pair {"prompt", "chosen",
    "rejected"}. Without a prompt it is the responses' shared start, found once tokenized."""
    kinds = _kinds(
        [(f, row.get(f)) for f in ("prompt", "chosen", "rejected")], where, optional="prompt"
    )
    prompt, responses = row.get("prompt"), [row["chosen"], row["rejected"]]
    if list(kinds.values()) == ["standard", "conversational", "conversational"]:
        # ultrafeedback_binarized's shape: the responses begin with the string prompt as a user
        # turn. As in the implicit shape, their shared first messages are the prompt.
        shared = _implicit_prompt(*responses, None, where)
        if not any(m["role"] == "user" and m["content"] == prompt for m in shared):
            raise DataError(
                f"{where}: field 'prompt' is a string that no user turn among the first "
                "messages 'chosen' and 'rejected' share repeats; begin both with it as a user "
                "turn, or give the prompt as a message list and the responses without it"
            )
        prompt, responses = shared, [r[len(shared) :] for r in responses]
    else:
        _same_kind(
            kinds,
            where,
            "all three as strings or as message lists (a string prompt goes with message-list "
            "responses that begin with it as a user turn)",
        )
    return (
        prompt,
        responses,
        [1.0, 0.0],
        ["chosen", "rejected"],
        kinds["chosen"] if "prompt" in kinds else f"implicit-prompt {kinds['chosen']}",
    )


def _k_shape(row: dict) -> tuple | None:
    """The first of _K_SHAPES whose responses and scores the row has, else the first whose
    responses it has (its error then names the scores the row lacks); None: a pair."""
    return next(
        (
            s
            for whole in (True, False)
            for s in _K_SHAPES
            if s[1] in row and (s[2] or s[3] in row or not whole)
        ),
        None,
    )


def _read_scored(row: dict, where: str) -> tuple:
    """(prompt, responses, scores, the responses' fields, kind) of a row of K scored responses in
    one of _K_SHAPES; the scores signed so that higher is better, NaN where missing or not finite
    (tokenize_rows drops such a row, and counts it)."""
    prompt_field, field, key, score, sign, chat = _k_shape(row)
    items = row[field]
    if not isinstance(items, list):
        raise DataError(
            f"{where}: field '{field}' must be a list of responses, got {type(items).__name__}"
        )
    for j, item in enumerate(items):
        if key and not isinstance(item, dict):
            raise DataError(
                f"{where}: field '{field}' item {j}: expected an object with '{key}' and "
                f"'{score}', got {json.dumps(item)[:80]}"
            )
    scores = [item.get(score) for item in items] if key else row.get(score)
    if not isinstance(scores, list) or len(scores) != len(items):
        got = (
            f"{len(scores)}"
            if isinstance(scores, list)
            else _JSON_KINDS.get(type(scores), type(scores).__name__)
        )
        raise DataError(
            f"{where}: field '{score}' must be a list of {len(items)} scores, one for each "
            f"response in field '{field}'; got {got}"
        )
    fields = [(prompt_field, row.get(prompt_field))] + [
        (f"{field}[{j}].{key}", item.get(key)) if key else (f"{field}[{j}]", item)
        for j, item in enumerate(items)
    ]
    kinds = _kinds(fields, where)
    prompt, responses = fields[0][1], [value for _, value in fields[1:]]
    _same_kind(kinds, where, "the prompt and every response as strings or as message lists")
    if chat and kinds[prompt_field] == "standard":
        # A user's request and a chat model's answers: trained as the chat they were.
        prompt, responses = (
            [{"role": "user", "content": prompt}],
            [[{"role": "assistant", "content": r}] for r in responses],
        )
    scores = [
        sign * float(s)
        if isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s)
        else math.nan
        for s in scores
    ]
    return (
        prompt,
        responses,
        scores,
        [label for label, _ in fields[1:]],
        f"{kinds[prompt_field]} with '{field}' and '{score}'",
    )


def _read_unpaired(row: dict, where: str) -> tuple:
    """TRL's unpaired row {"prompt", "completion", "label"}, read as a row of one response scored 1
    (desirable) or 0; _by_prompt then gathers a prompt's rows into one."""
    for name in ("prompt", "completion", "label"):
        if row.get(name) is None:
            raise DataError(
                f"{where}: missing field '{name}' (an unpaired row has prompt, completion and "
                "label)"
            )
    if not isinstance(row["label"], bool):
        raise DataError(
            f"{where}: field 'label' must be true or false, got {json.dumps(row['label'])[:80]}"
        )
    return _read_scored(
        {**row, "completion": [row["completion"]], "label": [float(row["label"])]}, where
    )


def _kinds(fields: list[tuple[str, object]], where: str, optional: str = "") -> dict[str, str]:
    """Each given field's kind, "standard" (a string) or "conversational" (a list of messages),
    which a row's fields must share; DataError naming the first field missing (unless it is
    `optional`) or neither."""
    for label, value in fields:
        if value is None and label != optional:
            raise DataError(f"{where}: missing field '{label}'")
        if isinstance(value, list):
            for i, m in enumerate(value):
                if not (
                    isinstance(m, dict)
                    and all(isinstance(m.get(k), str) for k in ("role", "content"))
                ):
                    raise DataError(
                        f"{where}: field '{label}' message {i}: expected {{\"role\": str, "
                        f'"content": str}}, got {json.dumps(m)[:80]}'
                    )
        elif value is not None and not isinstance(value, str):
            raise DataError(
                f"{where}: field '{label}' must be a string or a list of messages, got "
                f"{type(value).__name__}"
            )
    return {
        label: "conversational" if isinstance(value, list) else "standard"
        for label, value in fields
        if value is not None
    }


def _same_kind(kinds: dict[str, str], where: str, give: str) -> None:
    """DataError, saying to `give` the fields so, unless they are all strings or all message lists:
    each is rendered its own way (a template renders messages), so the prompt and responses must
    agree."""
    if len(set(kinds.values())) > 1:
        shapes = ", ".join(f"{k}: {v}" for k, v in kinds.items())
        raise DataError(f"{where}: fields mix strings and message lists ({shapes}); give {give}")


def _by_prompt(rows: list[dict], spec: str) -> list[dict]:
    """Unpaired rows as a row per prompt (where it first appears), its labelled responses in file
    order; DataError unless both labels occur."""
    grouped = {}
    for row in rows:
        group = grouped.setdefault(
            json.dumps(row["prompt"]),
            {**row, "responses": [], "scores": [], "cut": [], "fields": [], "unpaired": True},
        )
        for name in ("responses", "scores", "cut", "fields"):
            group[name] += row[name]
    labels = {score for row in rows for score in row["scores"]}
    if len(labels) < 2:
        raise DataError(
            f"{spec}: every label is {str(1.0 in labels).lower()}; an unpaired loss needs "
            "desirable and undesirable responses both"
        )
    return list(grouped.values())


def _read_source(spec: str) -> list[tuple[str, object]]:
    """(where, row) for each row of a .jsonl/.json file or hub dataset, `where` naming the row in
    errors: FILE:LINE in JSON Lines; FILE row N (from 1) in a JSON array, which json.loads decodes
    whole, without lines, and in a hub dataset."""
    if spec.startswith("hub:"):
        return [(f"{spec} row {i + 1}", row) for i, row in enumerate(_load_hub(spec))]
    data = _file_bytes(spec)
    try:
        # A leading byte-order mark is dropped.
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        # The lines before the bad byte's, and its own up to it.
        *lines, start = data[: e.start].split(b"\n")
        raise DataError(
            f"{spec}:{len(lines) + 1}: not UTF-8 text (byte 0x{data[e.start]:02x} at column "
            f"{len(start) + 1}); save the file as UTF-8"
        ) from None
    if not text.strip():
        raise DataError(f"{spec}:1: empty file, expected preference rows")
    if text.lstrip().startswith("["):
        return [(f"{spec} row {i + 1}", row) for i, row in enumerate(_loads(text, spec))]
    rows = [
        (f"{spec}:{line}", _loads(raw, spec, line))
        for line, raw in enumerate(text.splitlines(), start=1)
        if raw.strip()
    ]
    # A .json file holding one value, not an array: as JSON Lines it would be one pair (or a
    # non-object row), and fail later without naming the cause. More rows are JSON Lines under a
    # .json name, as datasets' to_json writes them.
    if spec.endswith(".json") and len(rows) == 1:
        raise DataError(
            f"{rows[0][0]}: expected a JSON array of pair objects, got "
            f"{_JSON_KINDS[type(rows[0][1])]}"
        )
    return rows


def _file_bytes(spec: str) -> bytes:
    """A data file's bytes; DataError naming it if there is none."""
    if not os.path.isfile(spec):
        raise DataError(
            f"{spec}: no such file (give a .jsonl/.json path, hub:NAME[:split] or demo)"
        )
    return Path(spec).read_bytes()


def _loads(text: str, spec: str, line: int = 1) -> object:
    """json.loads of `spec`'s text from `line` on, its error one line naming the file and line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{spec}:{line + e.lineno - 1}: invalid JSON ({e.msg} at column {e.colno})"
        ) from None


def write_jsonl(path: str, rows: list[dict]) -> str:
    """Write rows as JSON Lines, atomically (see write_atomic); returns the path."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return write_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _load_hub(spec: str):
    # hub:NAME, hub:NAME:SPLIT or hub:NAME:CONFIG:SPLIT.
    name, _, split = spec[len("hub:") :].partition(":")
    config, _, split = split.rpartition(":")
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{spec}: hub datasets need the datasets package (pip install datasets)"
        ) from None
    try:
        # A folder with a config is a dataset's files (load_dataset); without, save_to_disk's.
        if config or not os.path.isdir(name):
            return datasets.load_dataset(name, config or None, split=split or "train")
        ds = datasets.load_from_disk(name)
        return ds[split or "train"] if isinstance(ds, datasets.DatasetDict) else ds
    # The datasets package raises many types; all of them mean "cannot read this spec".
    except Exception as e:
        raise DataError(
            f"{spec}: cannot load ({type(e).__name__}: {str(e).strip().splitlines()[0]})"
        ) from None


def _render(row: dict, tokenizer) -> tuple[str, list[str]]:
    """(prompt, responses) text, the prompt ending where generation would start; a cut
    message-list response ends with its last message's text."""
    prompt, responses, where = row["prompt"], row["responses"], row["where"]
    if prompt is None:
        prompt = _implicit_prompt(*responses, tokenizer, where)
        responses = [r[len(prompt) :] for r in responses]
    if isinstance(prompt, str):
        return prompt, responses
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{where}: message lists need a chat template, and tokenizer "
            f"{tokenizer.name_or_path or type(tokenizer).__name__} has none (give --chat-template)"
        )
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    texts = []
    for j, response in enumerate(responses):
        full = (
            tokenizer.apply_chat_template(prompt + response, tokenize=False) if response else text
        )
        if not full.startswith(text):
            raise DataError(
                f"{where}: field '{row['fields'][j]}': the chat template renders the prompt "
                "differently once the response follows, so the two cannot be split"
            )
        texts.append(full[len(text) :])
        if row["cut"][j] and response:
            # A cut turn ends where its text stops: none of the template's end-of-turn after it.
            content = response[-1]["content"].strip()
            if content not in texts[-1]:
                raise DataError(
                    f"{where}: a cut response's last message is not in the chat template's text "
                    "of it, so where it stops cannot be found"
                )
            texts[-1] = texts[-1][: texts[-1].rfind(content) + len(content)] if content else ""
    return text, texts


def _implicit_prompt(chosen: str | list, rejected: str | list, tokenizer, where: str) -> str | list:
    # Message lists: the longest common run of messages.
    if isinstance(chosen, list):
        n = next(
            (i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b),
            min(len(chosen), len(rejected)),
        )
        if n == 0:
            raise DataError(
                f"{where}: fields 'chosen' and 'rejected' share no first message to use as the "
                "prompt; begin both with the prompt's messages"
            )
        return chosen[:n]
    shared = os.path.commonprefix([chosen, rejected])
    if _HH_MARKER in shared:
        return shared[: shared.rfind(_HH_MARKER) + len(_HH_MARKER)]
    chosen_ids, rejected_ids = tokenizer([chosen, rejected], add_special_tokens=False)["input_ids"]
    # Back off until the prefix's tokens begin both texts' tokens.
    for end in range(len(shared), 0, -1):
        ids = tokenizer(shared[:end], add_special_tokens=False)["input_ids"]
        if chosen_ids[: len(ids)] == ids and rejected_ids[: len(ids)] == ids:
            return shared[:end]
    raise DataError(f"{where}: fields 'chosen' and 'rejected' share no prefix to use as the prompt")


class RowTokens:
    """N rows' ids in one flat, memory-mappable int32 tensor, each row its prompt then its K
    responses (K from 2 to the split's most); tokens[i]: {"prompt": ids, "responses": [ids, ...],
    "scores": [float, ...]}. A pair is the responses [chosen, rejected], scored [1, 0]."""

    def __init__(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        scores: torch.Tensor,
        margins: torch.Tensor | None = None,
    ):
        self.ids = ids  # (total,) int32
        # (N, 1 + K) int64 [prompt, response 1, ..., response K]: 0 past a row's own responses.
        self.lengths = lengths
        self.scores = scores  # (N, K) float32, higher is better: NaN past a row's own responses
        # (N,) float32: each row's "margin" field (a reward model's, TRL's), 0 where absent.
        self.margins = torch.zeros(len(lengths)) if margins is None else margins
        self._starts = torch.cat(
            [torch.zeros(1, dtype=torch.long), lengths.sum(1).cumsum(0)]
        ).tolist()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, list]:
        p, *sizes = self.lengths[i].tolist()
        # Every response has a token at least: 0 is padding.
        ends = list(itertools.accumulate([n for n in sizes if n], initial=p))
        row = self.ids[self._starts[i] : self._starts[i + 1]].tolist()
        return {
            "prompt": row[:p],
            "responses": [row[a:b] for a, b in zip(ends, ends[1:])],
            "scores": self.scores[i][~self.scores[i].isnan()].tolist(),
            "margin": self.margins[i].item(),
        }


def with_mismatched(tokens: RowTokens, max_length: int) -> RowTokens:
    """KTO's rows: each row's responses, then as many mismatched completions, each the completion
    of the response before its own in the split's order (the first row's first takes the last
    row's last), cut to fit `max_length` after the row's prompt, keeping its start. TRL's
    KTOTrainer pairs them so within each batch, in file order: with every row in one batch, the
    same pairs. A row's lengths hold 0 between its responses and its mismatched ones where it has
    fewer responses than the split's most."""
    lengths = tokens.lengths  # (N, 1 + K)
    # Each segment's start in tokens.ids, where the rows lie end to end.
    starts = lengths.flatten().cumsum(0).view_as(lengths) - lengths
    real = lengths[:, 1:] > 0
    before = torch.zeros_like(lengths[:, 1:]).masked_scatter(real, starts[:, 1:][real].roll(1))
    # Cut to the room after the row's prompt; a 0 past the row's own responses stays 0.
    taken = torch.minimum(
        torch.zeros_like(lengths[:, 1:]).masked_scatter(real, lengths[:, 1:][real].roll(1)),
        max_length - lengths[:, :1],
    )
    segments = torch.cat([lengths, taken], 1)  # (N, 1 + 2K)
    flat = segments.flatten()
    # Each token's place in tokens.ids: its own place in the result, moved by how far its segment's
    # start there is from that segment's start in tokens.ids.
    shift = (torch.cat([starts, before], 1).flatten() - (flat.cumsum(0) - flat)).repeat_interleave(
        flat
    )
    return RowTokens(
        tokens.ids[torch.arange(len(shift)) + shift], segments, tokens.scores, tokens.margins
    )


def synthetic_rows(n: int, prompt: int, length: int, k: int) -> RowTokens:
    """n rows of a `prompt`-token prompt and k responses, each as long as `length` leaves (all
    token 0), scored k, ..., 1: rows of a given shape, for a memory plan without data."""
    lengths = torch.tensor([[prompt] + [length - prompt] * k] * n)
    return RowTokens(
        torch.zeros(int(lengths.sum()), dtype=torch.int32),
        lengths,
        torch.arange(k, 0, -1, dtype=torch.float32).repeat(n, 1),
    )


def tokenize_rows(
    rows: list[dict], tokenizer, config: DataConfig, progress=None
) -> tuple[RowTokens, dict]:
    """(tokens, summary) of read_rows rows, cut and dropped as docs/data.md says; the summary counts
    rows, responses, drops, cuts and lengths before cutting; progress(message) hears long runs."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; responses must end with one")
    prefix = _leading_special_ids(tokenizer)
    counts = dict.fromkeys(
        (
            "dropped_unscored",
            "dropped_tied",
            "dropped_empty",
            "dropped_identical",
            "identical_after_truncation",
            "empty_responses",
            "identical_responses",
            "truncated",
            "truncated_prompts",
            "truncated_responses",
            "retokenized",
            "cut_responses",
        ),
        0,
    )
    # Rows that rank nothing: a score missing or not finite, or all scores equal.
    scored = []
    for row in rows:
        counts["cut_responses"] += sum(row["cut"])
        # A response cut short loses --missing-eos-penalty before any pair is drawn, as in TRL;
        # an unpaired row's scores are its labels, which stay.
        penalty = 0.0 if row.get("unpaired") else config.missing_eos_penalty
        row = {
            **row,
            "scores": [s - penalty if c else s for s, c in zip(row["scores"], row["cut"])],
        }
        if not all(map(math.isfinite, row["scores"])):
            counts["dropped_unscored"] += 1
        elif len(set(row["scores"])) < 2 and not row.get("unpaired"):
            counts["dropped_tied"] += 1
        else:
            scored.append(row)
    # Each chunk's ids (after an empty tensor, so that no rows still concatenate), each kept row's
    # lengths and scores, and lengths before truncation.
    done = [torch.zeros(0, dtype=torch.int32)]
    lengths, scores, margins = [], [], []
    raw = {"prompt": [], "response": [], "pair": []}
    for s in range(0, len(scored), _CHUNK):
        if progress and len(scored) > 10 * _CHUNK and (s // _CHUNK) % 10 == 0:
            progress(f"tokenizing: {s}/{len(scored)} rows")
        chunk = scored[s : s + _CHUNK]
        texts = [_render(row, tokenizer) for row in chunk]
        prompts = tokenizer([p for p, _ in texts], add_special_tokens=False)["input_ids"]
        fulls = iter(
            tokenizer([p + r for p, rs in texts for r in rs], add_special_tokens=False)["input_ids"]
        )
        flat = []
        for row, (_, responses), ids in zip(chunk, texts, prompts):
            # A chat template writes BOS itself, and so do prompts rendered by one (RLHFlow's);
            # other plain text gets the tokenizer's leading specials.
            prompt = (
                ids
                if isinstance(row["responses"][0], list) or ids[: len(prefix)] == prefix
                else prefix + ids
            )
            if not prompt:
                raise DataError(
                    f"{row['where']}: field 'prompt' is empty and the tokenizer adds no BOS, so "
                    "the response's first token would have nothing to follow"
                )
            kept = _truncate(
                prompt,
                [
                    _response_ids(ids, r, next(fulls), tokenizer, counts, cut)
                    for r, cut in zip(responses, row["cut"])
                ],
                row["scores"],
                tokenizer.eos_token_id,
                prefix,
                config,
                counts,
                raw,
                # An unpaired row's responses stand alone: one is enough.
                1 if row.get("unpaired") else 2,
            )
            if kept:
                flat += kept[0] + [t for r, _ in kept[1] for t in r]
                lengths.append([len(kept[0])] + [len(r) for r, _ in kept[1]])
                scores.append([score for _, score in kept[1]])
                margins.append(row.get("margin", 0.0))
        # As int32: Python ints would take several times the memory.
        done.append(torch.tensor(flat, dtype=torch.int32))
    # 1 + the most responses a row kept; rows with fewer are padded.
    width = max(map(len, lengths), default=3)
    tokens = RowTokens(
        torch.cat(done),
        torch.tensor([n + [0] * (width - len(n)) for n in lengths], dtype=torch.long).view(
            -1, width
        ),
        torch.tensor(
            [x + [math.nan] * (width - 1 - len(x)) for x in scores], dtype=torch.float32
        ).view(-1, width - 1),
        torch.tensor(margins, dtype=torch.float32),
    )
    return tokens, {
        "rows": len(tokens),
        "unpaired": any(row.get("unpaired") for row in rows),
        "pairs": _pairs_by_choice(tokens.scores),
        "responses": int(tokens.lengths[:, 1:].count_nonzero()),
        "dropped": sum(v for k, v in counts.items() if k.startswith("dropped_")),
        **counts,
        "tokens_before_truncation": {k: _percentiles(v) for k, v in raw.items()},
    }


def _response_ids(
    prompt: list[int], text: str, full: list[int], tokenizer, counts: dict, cut: bool
) -> list[int]:
    """A response's ids, ending with one EOS: the template's own if only whitespace follows it, else
    an appended one; none if it was `cut` short."""
    if full[: len(prompt)] == prompt:
        ids = full[len(prompt) :]
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        counts["retokenized"] += 1
    if cut:
        return ids
    if tokenizer.eos_token_id in ids:
        last = len(ids) - 1 - ids[::-1].index(tokenizer.eos_token_id)
        if not tokenizer.decode(ids[last + 1 :]).strip():
            return ids[: last + 1]
    return ids + [tokenizer.eos_token_id]


def _truncate(
    prompt: list[int],
    responses: list[list[int]],
    scores: list[float],
    eos_id: int,
    prefix: list[int],
    config: DataConfig,
    counts: dict,
    raw: dict,
    need: int,
) -> tuple[list[int], list[tuple[list[int], float]]] | None:
    """(prompt, [(response, score)]) cut to config's limits, without empty responses or repeats of
    an earlier one (counted); None when fewer than `need` distinct scores are left (counted)."""
    # Nothing, or nothing but EOS: no answer to rank.
    kept = [(r, score) for r, score in zip(responses, scores) if r not in ([], [eos_id])]
    counts["empty_responses"] += len(responses) - len(kept)
    if len({score for _, score in kept}) < need:
        counts["dropped_empty"] += 1
        return None
    kept = _distinct(kept, counts)
    if len({score for _, score in kept}) < need:
        counts["dropped_identical"] += 1
        return None
    longest = max(len(r) for r, _ in kept)
    for key, n in (("prompt", len(prompt)), ("response", longest), ("pair", len(prompt) + longest)):
        raw[key].append(n)
    if len(prompt) + longest <= config.max_length:
        return prompt, kept
    cut_prompt = len(prompt) > config.prompt_limit
    if cut_prompt and config.truncation == "keep_start":
        prompt = prompt[: config.prompt_limit]
    elif cut_prompt:
        # A leading BOS stays when the start is cut away.
        head = prefix if prompt[: len(prefix)] == prefix else []
        prompt = head + prompt[len(prompt) - (config.prompt_limit - len(head)) :]
    room = config.max_length - len(prompt)
    # A row over max_length always loses prompt or response tokens.
    counts["truncated"] += 1
    counts["truncated_prompts"] += int(cut_prompt)
    counts["truncated_responses"] += int(longest > room)
    # Responses that differ only past the cut teach nothing either.
    kept = _distinct([(r[:room], score) for r, score in kept], counts)
    if len({score for _, score in kept}) < need:
        counts["dropped_identical"] += 1
        counts["identical_after_truncation"] += 1
        return None
    return prompt, kept


def _distinct(kept: list[tuple[list[int], float]], counts: dict) -> list[tuple[list[int], float]]:
    # A response repeated teaches nothing new, or contradicts itself under another score: the first
    # stays (a row's order ranks nothing).
    unique = {}
    for ids, score in kept:
        unique.setdefault(tuple(ids), (ids, score))
    counts["identical_responses"] += len(kept) - len(unique)
    return list(unique.values())


def _pairs_by_choice(scores: torch.Tensor) -> dict[str, int]:
    """The pairs that rows of these (N, K) scores (NaN past a row's responses) give under each
    --pairs, as batches.row_pairs draws them: ties never pair, and a row's tied bests count once."""
    best = scores.nan_to_num(-math.inf).amax(1, keepdim=True)
    return {
        "all": int((scores[:, :, None] > scores[:, None, :]).sum()),
        "best-vs-rest": int((scores < best).sum()),
        # Rows of two scores or more (an unpaired row may hold one).
        "best-vs-worst": int((best[:, 0] > scores.nan_to_num(math.inf).amin(1)).sum()),
    }


def _leading_special_ids(tokenizer) -> list[int]:
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    return next(
        (full[:i] for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain),
        [],
    )


def _percentiles(values: list[int]) -> dict:
    ordered = sorted(values)
    # No values, no percentiles.
    return {
        f"p{q}": ordered[min(len(ordered) - 1, len(ordered) * q // 100)]
        for q in (50, 90, 99, 100)
        if ordered
    }


def tokenize_to_cache(config: DataConfig, tokenizer, progress=None) -> str:
    """{cache_dir}/tokens-<hash of sources, settings, tokenizer>.pt, made unless there (by one rank;
    all load it)."""
    tokenizer_key = key_digest(
        [
            type(tokenizer).__name__,
            sorted(tokenizer.get_vocab().items()),
            # Its text (--chat-template's too): an edited template file makes a new key.
            tokenizer.chat_template,
            tokenizer.eos_token_id,
            _leading_special_ids(tokenizer),
        ]
    )
    key = {
        "version": _CACHE_VERSION,
        "settings": {k: v for k, v in asdict(config).items() if k != "cache_dir"},
        "tokenizer": tokenizer_key,
        "train": [_fingerprint(s) for s in config.data],
        "eval": [_fingerprint(s) for s in config.eval_data],
    }
    digest = key_digest(key)[:20]
    path = os.path.join(config.cache_dir, f"tokens-{digest}.pt")
    if os.path.exists(path):
        return path
    rows = [row for spec in config.data for row in read_rows(spec)]
    # Held out: --eval-data's rows, or --eval-fraction's share of these (none without it), picked
    # by a fixed shuffle, the same whatever --seed.
    held = set(random.Random(0).sample(range(len(rows)), round(config.eval_fraction * len(rows))))
    eval_rows = [row for spec in config.eval_data for row in read_rows(spec)]
    eval_rows += [r for i, r in enumerate(rows) if i in held]
    rows = [r for i, r in enumerate(rows) if i not in held]
    train, train_summary = tokenize_rows(rows, tokenizer, config, progress)
    evals, eval_summary = tokenize_rows(eval_rows, tokenizer, config, progress)
    if not len(train):
        why = [
            f"{train_summary[k]} "
            + reason.format(max_length=config.max_length, prompt_limit=config.prompt_limit)
            for k, reason in _DROPPED.items()
            if train_summary[k]
        ]
        raise DataError(f"{','.join(config.data)}: every row was dropped: {'; '.join(why)}")
    # What fixes the training pairs, for resume checks: the files, and how this code and tokenizer
    # cut them.
    summary = {
        "fingerprint": digest,
        "train_sha256": key_digest([key["train"], _CACHE_VERSION, tokenizer_key]),
        "train": train_summary,
        "eval": eval_summary,
    }
    return write_atomic(
        path,
        lambda tmp: torch.save(
            {
                "train_ids": train.ids,
                "train_lengths": train.lengths,
                "train_scores": train.scores,
                "train_margins": train.margins,
                "eval_ids": evals.ids,
                "eval_lengths": evals.lengths,
                "eval_scores": evals.scores,
                "eval_margins": evals.margins,
                "summary": json.dumps(summary),
            },
            tmp,
        ),
    )


def load_tokens(path: str) -> tuple[RowTokens, RowTokens, dict]:
    """(train, eval, summary) from a tokenize_to_cache file, memory-mapped: ranks on a node share
    one copy."""
    saved = torch.load(path, mmap=True, weights_only=True)
    return (
        *(
            RowTokens(
                *(saved[f"{split}_{part}"] for part in ("ids", "lengths", "scores", "margins"))
            )
            for split in ("train", "eval")
        ),
        json.loads(saved["summary"]),
    )


def key_digest(key) -> str:
    """sha256 hex of a JSON-able key: what names a cache file after everything its content depends
    on."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def write_atomic(path: str, write) -> str:
    """write(tmp) beside `path` (its folder made if need be), then rename: a reader never sees half
    a file. Where the write fails (a full disk), its file is removed and a ValueError names the
    folder."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        write(tmp)
    except (OSError, RuntimeError) as e:
        # A full disk (torch.save says so as a RuntimeError): nothing half-written stays.
        Path(tmp).unlink(missing_ok=True)
        reason = str(e).strip().partition("\n")[0]
        raise ValueError(f"{folder}: cannot write {os.path.basename(path)} ({reason})") from None
    os.replace(tmp, path)
    return path


def _fingerprint(spec: str) -> str:
    if spec.startswith("hub:"):
        return f"{spec}:{_load_hub(spec)._fingerprint}"
    return hashlib.sha256(_file_bytes(spec)).hexdigest()


def load_tokenizer(name: str, chat_template: str | None = None):
    """A hub id's or folder's tokenizer (ValueError naming --model); "tiny": ByT5's bytes, with a
    chat template. chat_template: --chat-template, a Jinja file or the name of one in
    _CHAT_TEMPLATES, which replaces the tokenizer's own (and is saved with it)."""
    if name.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(name)):
        raise ValueError(f"--model {name}: no such folder")
    if name == "tiny":
        tokenizer = transformers.ByT5Tokenizer(
            chat_template=(
                "{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content }}"
                "{% if m.role == 'assistant' %}{{ '</s>' }}{% endif %}{{ '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
            )
        )
    else:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(name)
        except OSError as e:
            raise ValueError(
                f"--model {name}: cannot load ({str(e).strip().splitlines()[0]})"
            ) from None
    if chat_template and chat_template not in _CHAT_TEMPLATES and not os.path.isfile(chat_template):
        raise ValueError(
            f"--chat-template {chat_template}: no such file, and not a template this project "
            f"ships ({', '.join(_CHAT_TEMPLATES)})"
        )
    if chat_template:
        # A shipped template's name wins over a file of that name.
        tokenizer.chat_template = (
            _CHAT_TEMPLATES[chat_template]
            if chat_template in _CHAT_TEMPLATES
            else Path(chat_template).read_text(encoding="utf-8")
        )
    return tokenizer


def inspect(argv: list[str] | None = None) -> None:
    """python data.py PATH --model NAME [--max-length N] [--max-prompt-length N] [--truncation T]
    [--chat-template T] [--missing-eos-penalty X] [--show N] [--micro-batch-tokens N]: N JSON lines
    decoded from exactly the tokens that will be trained, then one JSON summary line (its "pairs":
    how many each --pairs draws; with --micro-batch-tokens, "packing": how the rows pack). A pair
    file's rows show as {"prompt", "chosen", "rejected"}, rows of K scored responses as {"prompt",
    "responses": [{"score", "text"}, ...]}; either with "cut", a bool per response, where any ends
    without EOS; an unpaired file's as a line {"prompt", "completion", "label"} per response, each
    row's responses together."""
    parser = argparse.ArgumentParser(prog="data.py", description=inspect.__doc__.split(":")[0])
    parser.add_argument(
        "path", help="file(s) (comma-separated), hub:NAME[:SPLIT] or hub:NAME:CONFIG:SPLIT"
    )
    parser.add_argument(
        "--model", required=True, help='hub id, folder, or "tiny" (train_dpo.py\'s byte tokenizer)'
    )
    parser.add_argument("--max-length", type=int, default=DataConfig.max_length)
    parser.add_argument("--max-prompt-length", type=int, help="default: half of --max-length")
    parser.add_argument(
        "--truncation", choices=("keep_end", "keep_start"), default=DataConfig.truncation
    )
    parser.add_argument(
        "--chat-template", help="a Jinja file or chatml, in place of the tokenizer's template"
    )
    parser.add_argument(
        "--missing-eos-penalty",
        type=float,
        default=DataConfig.missing_eos_penalty,
        help="taken from a cut response's score",
    )
    parser.add_argument("--show", type=int, default=3, help="rows to print")
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        help="also report how the rows pack (train_dpo.py --packing) into micro-batches of at most "
        "this many tokens",
    )
    args = parser.parse_args(argv)
    transformers.utils.logging.set_verbosity_error()
    try:
        config = DataConfig(
            data=(args.path,),
            max_length=args.max_length,
            max_prompt_length=args.max_prompt_length,
            truncation=args.truncation,
            chat_template=args.chat_template,
            missing_eos_penalty=args.missing_eos_penalty,
        )
        tokenizer = load_tokenizer(args.model, args.chat_template)
        rows = [row for spec in config.data for row in read_rows(spec)]
        tokens, summary = tokenize_rows(rows, tokenizer, config)
    except (ValueError, OSError) as e:
        parser.exit(2, f"error: {e}\n")
    # Pairs show as the user wrote them; K scored responses as a list, and so do pairs whose scores
    # a penalty may have turned around.
    pairs = not args.missing_eos_penalty and all(
        row["fields"] == ["chosen", "rejected"] for row in rows
    )
    for row in (tokens[i] for i in range(min(args.show, len(tokens)))):
        prompt = tokenizer.decode(row["prompt"])
        # As a row says it: which responses end without EOS (cut short, or by --max-length).
        cut = [ids[-1] != tokenizer.eos_token_id for ids in row["responses"]]
        if pairs:
            shown = {
                "prompt": prompt,
                "chosen": tokenizer.decode(row["responses"][0]),
                "rejected": tokenizer.decode(row["responses"][1]),
            }
        else:
            # Scores as read, not float32's digits (0.1, not 0.10000000149011612).
            shown = {
                "prompt": prompt,
                "responses": [
                    {"score": float(f"{score:.7g}"), "text": tokenizer.decode(ids)}
                    for ids, score in zip(row["responses"], row["scores"])
                ],
            }
        lines = [shown | ({"cut": cut} if any(cut) else {})]
        if summary["unpaired"]:
            # A line per labelled response, as TRL's unpaired rows are written.
            lines = [
                {"prompt": prompt, "completion": tokenizer.decode(ids), "label": score == 1}
                | ({"cut": [True]} if c else {})
                for ids, score, c in zip(row["responses"], row["scores"], cut)
            ]
        for line in lines:
            print(json.dumps(line, ensure_ascii=False))
    if args.micro_batch_tokens:
        summary["packing"] = _packing(tokens, args.micro_batch_tokens)
    print(json.dumps(summary))


def _packing(tokens: RowTokens, limit: int) -> dict:
    """How the rows pack, greedily in their order (training packs each step's rows, in its order),
    into micro-batches of at most `limit` tokens (a longer row alone), laid out as shared rows
    [prompt | r1 | ... | rK]: how many micro-batches, their mean rows, and the share of their token
    budget that tokens fill (packed, none is padding)."""
    sizes = tokens.lengths.sum(1).tolist()
    packs = []
    for size in sizes:
        if not packs or packs[-1] + size > limit:
            packs.append(0)
        packs[-1] += size
    return {
        "micro_batch_tokens": limit,
        "micro_batches": len(packs),
        "rows_per_micro_batch": round(len(sizes) / len(packs), 2),
        "fill": round(sum(sizes) / (len(packs) * limit), 3),
    }


if __name__ == "__main__":
    inspect()
