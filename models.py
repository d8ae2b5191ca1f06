"""Hugging Face causal LMs to train: the built-in tiny model, or a hub id or folder, read and
written one tensor at a time so that no process holds the whole model.

Copyable on its own: imports only the standard library, torch and transformers.

This runs as written:

    import os
    import tempfile

    import torch
    import transformers
    from models import build_model, load_model_config, model_identity, open_weights, save_pretrained

    tokenizer = transformers.ByT5Tokenizer()  # bytes: needs no files, as the tiny model
    config = load_model_config("tiny", tokenizer)  # small files: on every rank
    model = build_model(config)  # parameters on the meta device, buffers computed on CPU
    weights = open_weights("tiny", config, seed=0)  # {name: CPU tensor}; files memory-mapped
    key = model_identity("tiny", config, seed=0)  # what fixes its weights, for cache keys
    # The whole model on the CPU; in training each rank loads its shards (fsdp_setup.build_sharded).
    model.load_state_dict(weights, assign=True)
    model.tie_weights()
    ids = tokenizer("Hello", return_tensors="pt").input_ids
    print(sum(p.numel() for p in model.parameters()), tuple(model(ids).logits.shape))
    folder = tempfile.mkdtemp()
    # entries: (name, tensor, fetch) as fsdp_setup.full_tensors gives them; rank 0 writes
    entries = [(name, p, p.detach) for name, p in model.named_parameters()]
    save_pretrained(folder, model, entries, torch.bfloat16)  # a folder Hugging Face loads
    saved = open_weights(folder, config, seed=0)  # read back, one tensor at a time
    print(sorted(os.listdir(folder)), saved["model.embed_tokens.weight"].dtype)
"""

import copy
import glob
import json
import os

import torch
import torch.distributed as dist
import transformers
from torch.nn.utils.rnn import pad_sequence
from transformers import conversion_mapping, core_model_loading

# safetensors' dtype names
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_FILE_BYTES = 50 * 2**30  # Hugging Face's default largest weight file


def load_model_config(
    name: str, tokenizer=None, max_length: int = 0
) -> transformers.PretrainedConfig:
    """The config of "tiny" (a ~1M-parameter Llama over `tokenizer`'s vocabulary: trains on a laptop
    CPU, needs no files), a hub id or a local folder. Raises ValueError naming the flag when it
    cannot be read, or when the model has fewer positions than max_length."""
    if name == "tiny":
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    else:
        try:
            config = transformers.AutoConfig.from_pretrained(name)
        except OSError as e:
            raise ValueError(
                f"--model {name}: cannot load ({str(e).strip().splitlines()[0]})"
            ) from None
    positions = getattr(config, "max_position_embeddings", None)
    if positions and max_length > positions:
        raise ValueError(f"--max-length {max_length} exceeds the model's {positions} positions")
    return config


def build_model(config) -> torch.nn.Module:
    """The model with float32 parameters on the meta device (no memory, no init) and its buffers
    made for real on the CPU: non-persistent ones such as rotary frequency tables are computed at
    build time, in no weight file.

    While it builds, torch.nn.Module.register_parameter, for every module, moves each parameter to
    the meta device as it is registered, before the layer initializes it: what accelerate's
    init_empty_weights(include_buffers=False) does. (Under torch.device("meta"), computed buffers
    such as rotary tables would be on meta too, and lost.)"""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        # A tie registers a parameter that is on meta already: it must stay that same parameter.
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        return _model_class(config).from_config(config, dtype=torch.float32)
    finally:
        torch.nn.Module.register_parameter = register


def _model_class(config):
    """The class a config builds: a sequence classifier for one label (a reward model's, as the
    caller sets num_labels), else a causal LM."""
    if getattr(config, "num_labels", None) == 1:
        return transformers.AutoModelForSequenceClassification
    return transformers.AutoModelForCausalLM


def find_weights(name: str) -> list[str]:
    """The local paths of a folder's or hub id's safetensors files, downloaded first if need be; []
    for tiny."""
    if name == "tiny":
        return []
    index = transformers.utils.cached_file(
        name, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False
    )
    if index is None:
        single = transformers.utils.cached_file(
            name, "model.safetensors", _raise_exceptions_for_missing_entries=False
        )
        if single is None:
            raise ValueError(
                f"--model {name}: no model.safetensors nor model.safetensors.index.json (weights "
                "in .bin files: load the model and save_pretrained it once to convert them)"
            )
        return [single]
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    return [transformers.utils.cached_file(name, file) for file in files]


def open_weights(name: str, config, seed: int) -> dict[str, torch.Tensor]:
    """Every weight by its name in the files, as CPU tensors: a folder's or hub id's safetensors
    files memory-mapped in their own dtype (a slice reads only its own bytes), or the tiny model's
    random init from `seed`. A config with one label reads a sequence classifier (a reward model):
    from a causal LM's files, with a new scalar head drawn from `seed`."""
    if name == "tiny":
        torch.manual_seed(seed)
        return _model_class(config).from_config(config, dtype=torch.float32).state_dict()
    # Under the files' names: transformers may rename or fuse them for the model.
    weights = {}
    for path in find_weights(name):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        # The file's own notes, not a tensor.
        header.pop("__metadata__", None)
        # The whole file as bytes, memory-mapped (privately, the default: never written back); the
        # tensors' data starts after the header.
        data = torch.from_file(path, size=os.path.getsize(path), dtype=torch.uint8)[8 + size :]
        for key, meta in header.items():
            begin, end = meta["data_offsets"]
            dtype = _DTYPES[meta["dtype"]]
            # A typed view needs aligned bytes, which writers other than this one need not give:
            # then a copy.
            piece = data[begin:end].clone() if begin % dtype.itemsize else data[begin:end]
            weights[key] = piece.view(dtype).view(meta["shape"])
    model = build_model(config)
    weights = _converted_for(model, weights)
    head = model.state_dict().get("score.weight")
    if head is not None and "score.weight" not in weights:
        # A causal LM read as a reward model: a new scalar head, drawn as transformers draws one
        # (TRL's start), from `seed`; the output layer's weight is not read.
        generator = torch.Generator().manual_seed(seed)
        weights["score.weight"] = getattr(config, "initializer_range", 0.02) * torch.randn(
            head.shape, generator=generator
        )
    return weights


def _converted_for(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict:
    """The files' `weights` under `model`'s parameter names, as transformers' from_pretrained
    converts them for its class (its own renames, e.g. GPT-NeoX's embed_out as lm_head, and
    converters, e.g. a mixture-of-experts layer's experts stacked into one tensor): a weight that a
    converter builds is a _Converted, made when its rows are asked for."""
    mapping = conversion_mapping.get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, core_model_loading.WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, core_model_loading.WeightConverter)]
    names = model.state_dict()
    converted = {}
    # In transformers' order, which puts expert 2 before expert 10.
    for key in sorted(weights, key=core_model_loading.dot_natural_key):
        name, pattern = core_model_loading.rename_source_key(
            key, renamings, converters, model.base_model_prefix, names
        )
        if pattern is None:
            converted[name] = weights[key]
        else:
            converter = next(c for c in converters if pattern in c.source_patterns)
            target = converted.setdefault(name, _Converted(converter, model.config))
            target.sources.setdefault(pattern, []).append(weights[key])
    return converted


class _Converted:
    """A weight that a transformers converter builds from several in the files. Its rows are made
    on demand: where the converter first stacks a list (one tensor per expert) on dim 0 and then
    works within rows, only the asked rows' tensors are read (a rank reads its own experts' bytes);
    otherwise the whole weight is made, then sliced."""

    def __init__(self, converter: core_model_loading.WeightConverter, config):
        self.converter = converter
        self.config = config
        # {source pattern: [tensors in the files]}, as the converter's operations take them.
        self.sources = {}

    @property
    def shape(self) -> torch.Size:
        return self._convert(self.sources, device="meta").shape

    def __getitem__(self, rows: slice) -> torch.Tensor:
        first, *rest = self.converter.operations
        if (
            isinstance(first, core_model_loading.MergeModulelist)
            and first.dim == 0
            and all(getattr(op, "dim", 0) > 0 for op in rest)
        ):
            return self._convert({p: tensors[rows] for p, tensors in self.sources.items()})
        return self._convert(self.sources)[rows]

    def _convert(self, sources: dict, device: str = "cpu") -> torch.Tensor:
        # The operations consume their input dict: a fresh one each time.
        tensors = {p: [t.to(device) for t in listed] for p, listed in sources.items()}
        for op in self.converter.operations:
            tensors = op.convert(
                tensors,
                source_patterns=self.converter.source_patterns,
                target_patterns=self.converter.target_patterns,
                config=self.config,
            )
        return tensors[self.converter.target_patterns[0]]


def save_pretrained(folder: str, model: torch.nn.Module, entries: list, dtype: torch.dtype) -> None:
    """A Hugging Face folder of `model` (config, generation config) with the weights of `entries`,
    floats in `dtype`, as model.safetensors (numbered files and their index past 50 GB), holding one
    tensor at a time. entries: (name, tensor, fetch): the model's tensor, sharded or not, for its
    shape and dtype, and fetch() its full value. Every rank calls, as fetch may be a collective;
    rank 0 writes. The files hold what the model's own save_pretrained writes (_saved_groups)."""
    # A plain build of the class: transformers looks conversions up by class name, which FSDP2
    # changes.
    plain = build_model(model.config)
    groups = _saved_groups(plain, entries, dtype)
    if dist.is_initialized() and dist.get_rank() > 0:
        # The other ranks take part in each gather, in rank 0's order.
        for group, _ in groups:
            for _, _, fetch in group:
                fetch()
        return
    # Each file's groups; a new file past 50 GB.
    files = [[]]
    size = 0
    for group, saved in groups:
        nbytes = sum(t.nbytes for t in saved.values())
        if files[-1] and size + nbytes > _FILE_BYTES:
            files.append([])
            size = 0
        files[-1].append((group, saved))
        size += nbytes
    os.makedirs(folder, exist_ok=True)
    # An earlier export's files go, which may be split otherwise.
    for old in glob.glob(os.path.join(folder, "model*.safetensors*")):
        os.remove(old)
    # The export's dtype, not the float32 masters'; and the class vLLM builds, not FSDP2's.
    model.config.dtype = dtype
    model.config.architectures = [type(plain).__name__]
    model.config.save_pretrained(folder)
    # A sequence classifier (a reward model) generates nothing: it has no generation config.
    if getattr(model, "generation_config", None):
        model.generation_config.save_pretrained(folder)
    weight_map = {}
    for i, in_file in enumerate(files):
        file = (
            f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            if len(files) > 1
            else "model.safetensors"
        )
        header = {"__metadata__": {"format": "pt"}}
        offset = 0
        for _, saved in in_file:
            for name, tensor in saved.items():
                header[name] = {
                    "dtype": _NAMES[tensor.dtype],
                    "shape": list(tensor.shape),
                    "data_offsets": [offset, offset + tensor.nbytes],
                }
                offset += tensor.nbytes
                weight_map[name] = file
        text = json.dumps(header).encode()
        # The data starts 8-byte aligned.
        text += b" " * (-len(text) % 8)
        path = os.path.join(folder, file)
        with open(path + ".tmp", "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            for group, saved in in_file:
                tensors = core_model_loading.revert_weight_conversion(
                    plain, {key: fetch() for key, _, fetch in group}
                )
                for name, tensor in saved.items():
                    written = tensors.pop(name).to("cpu", tensor.dtype).contiguous()
                    f.write(written.view(-1).view(torch.uint8).numpy())
        # A rename: a file is whole or absent.
        os.replace(path + ".tmp", path)
    if len(files) > 1:
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            total = sum(t.nbytes for _, saved in groups for t in saved.values())
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _saved_groups(plain: torch.nn.Module, entries: list, dtype: torch.dtype) -> list:
    """`entries` grouped as save_pretrained of the `plain` model converts them back to the layout
    transformers loads (GPT-NeoX's lm_head as embed_out; a layer's stacked experts as one tensor per
    expert and projection), which older transformers, vLLM and other tools read: [(entries, {saved
    name: meta tensor, floats in `dtype`})], the entries of a group fetched together."""
    reverse = [
        t.reverse_transform()
        for t in conversion_mapping.get_model_conversion_mapping(plain, add_legacy=False)[::-1]
        if isinstance(t, core_model_loading.WeightConverter)
    ]
    groups = {}
    for entry in entries:
        target, pattern = core_model_loading.apply_converters(entry[0], reverse)
        groups.setdefault(target if pattern else entry[0], []).append(entry)
    saved = []
    for group in groups.values():
        shapes = {
            name: torch.empty(
                t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device="meta"
            )
            for name, t, _ in group
        }
        saved.append((group, core_model_loading.revert_weight_conversion(plain, shapes)))
    return saved


def model_identity(name: str, config, seed: int) -> dict:
    """What fixes a model's initial weights: the seed for tiny; else the name, the hub commit, the
    weight files."""
    if name == "tiny":
        return {"tiny": seed, "config": config.to_dict()}
    folder = os.path.expanduser(name)
    # A hub id has no folder here: its commit says it all.
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return {
        "name": name,
        "commit": getattr(config, "_commit_hash", None),
        "files": [
            (f, os.path.getsize(os.path.join(folder, f)), os.path.getmtime(os.path.join(folder, f)))
            for f in names
            if f.endswith((".safetensors", ".bin"))
        ],
    }


# -------------------------------------------------------------------------- the shared-prompt probe
# The probe's verdicts, once per process: by (model type, attention, config as JSON), "" where
# shared rows scored as separate ones, else why not (shared_prompt_refusal).
_PROBED: dict[tuple, str] = {}
# The probe's model: the model's own config with these fields made small where it sets them (not
# None or 0): 4 heads of the model's own width (so that rotary dims and rope scaling tables stay
# as they are; as many for keys and values, as latent attention needs), 16 small experts (groups
# of routed experts keep 2 each), windows (sliding, local, chunked) shorter than its rows, token
# ids dropped (the real ones lie outside the small vocabulary).
_PROBE_SIZES = {
    "vocab_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_kv_heads": 4,
    "intermediate_size": 32,
    "ffn_dim": 32,
    "n_inner": 32,
    "ffn_hidden_size": 32,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_local_experts": 16,
    "num_experts": 16,
    "n_routed_experts": 16,
    "moe_num_experts": 16,
    "num_experts_per_tok": 2,
    "sliding_window": 4,
    "window_size": 4,
    "attention_chunk_size": 4,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}


def shared_prompt_refusal(config, row_inputs) -> str:
    """Why a model of this config, in its attention implementation, does not score shared-prompt
    rows as it scores separate rows, in a line; "" where it does. `row_inputs(config, position_ids,
    segment_ids)` gives the model's inputs for shared rows (logps.shared_row_inputs: the positions
    and the mask training passes). Probed once per process for each model type, attention and
    config (_probe), on a copy of the config cut down, never on the model itself."""
    # The attention implementations that take a shared prompt's mask: boolean for SDPA, additive
    # for eager, a block mask for FlexAttention. Whether a model's attention takes that mask and the
    # positions exactly is probed: its transformers code, not a list of names.
    if config._attn_implementation not in ("sdpa", "eager", "flex_attention"):
        return f"{config._attn_implementation} attention takes no dense mask"
    if any(hasattr(value, "model_type") for value in vars(config).values()):
        # The probe would build the parts of other configs (a vision tower) at their full size.
        return f"{config.model_type} holds other models' configs: not probed"
    key = (config.model_type, config._attn_implementation, config.to_json_string(use_diff=False))
    if key not in _PROBED:
        _PROBED[key] = _probe(config, row_inputs)
    return _PROBED[key]


def _probe(config, row_inputs) -> str:
    """shared_prompt_refusal's verdict: a model of `config` cut down (_PROBE_SIZES; 2 layers, one
    at least of each kind in layer_types) with random float32 weights on the CPU, from seed 0 (the
    caller's random state kept; every rank agrees), scores a few pairs in shared and in separate
    rows, whose responses' log-probs must agree within 1e-5 of the largest; or the error of a model
    that refuses the mask or the positions (BLOOM's ALiBi, made from a 2D mask alone) or the cut."""
    threads = torch.get_num_threads()
    try:
        # Tiny matrices: one thread is fastest, and spins on no other process's cores (seconds
        # instead of milliseconds on a busy host).
        torch.set_num_threads(1)
        small = copy.deepcopy(config)
        small.update({name: v for name, v in _PROBE_SIZES.items() if getattr(config, name, None)})
        # 4 heads of the model's own width: its head_dim, or hidden_size over heads.
        small.hidden_size = 4 * (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        if getattr(config, "layer_types", None):
            small.num_hidden_layers = max(2, len(set(config.layer_types)))
            # Each kind's first layer, then the model's first layers up to two in all.
            small.layer_types = [*dict.fromkeys(config.layer_types), *config.layer_types][
                : small.num_hidden_layers
            ]
        with torch.random.fork_rng(devices=()), torch.no_grad():
            torch.manual_seed(0)
            # FlexAttention compiles on a CPU (tens of seconds; some masks fail to): probed in
            # eager attention, which every model has, with the same mask as a tensor.
            model = transformers.AutoModelForCausalLM.from_config(
                small,
                attn_implementation=config._attn_implementation.replace("flex_attention", "eager"),
                dtype=torch.float32,
            ).eval()
            # (prompt, chosen, rejected) lengths: rows longer than the windows (4), responses of
            # unequal lengths both ways, a one-token prompt, padding in both layouts.
            pairs = [
                [torch.randint(1, 64, (n,), device="cpu") for n in lengths]
                for lengths in ((6, 4, 7), (1, 5, 2), (3, 2, 1))
            ]
            shared = _probe_logps(model, pairs, row_inputs)
            packed = _probe_logps(model, pairs, row_inputs, packed=True)
            # A row per response, in the shared rows' order: each pair's chosen, then rejected.
            separate = _probe_logps(model, [[p, r] for p, *responses in pairs for r in responses])
    except Exception as e:  # a model that cannot take the layout (or be cut down): separate rows
        return f"its probe raised {type(e).__name__}: " + str(e).strip().partition("\n")[0]
    finally:
        torch.set_num_threads(threads)
    gap = torch.stack([shared - separate, packed - separate]).abs().max().item()
    return (
        f"its probe's shared or packed rows scored {gap:.2g} off separate rows"
        if gap > 1e-5 * separate.abs().max().item()
        else ""
    )


def _probe_logps(model, rows: list, row_inputs=None, packed=False) -> torch.Tensor:
    """Each response's summed log-probs, in row order, of rows [prompt | r1 | ...] of (n,) int64
    tensors on the CPU: with `row_inputs` as shared rows (each response's positions starting where
    the prompt ends, seeing the prompt and itself), else as plain causal rows; `packed`: the shared
    rows end to end in one, each a document of its own. A response's first token is predicted at
    the prompt's last position, the others at their own predecessors'."""
    positions = [
        torch.cat(
            [
                torch.arange(len(t), device="cpu") + min(s, 1) * len(row[0])
                for s, t in enumerate(row)
            ]
        )
        for row in rows
    ]
    segments = [torch.cat([torch.full_like(t, s) for s, t in enumerate(row)]) for row in rows]
    ids = [torch.cat(row) for row in rows]
    documents = None
    if packed:
        documents = torch.cat([torch.full_like(t, b) for b, t in enumerate(ids)])[None]  # (1, T)
        positions = [torch.cat(positions)]
        segments = [torch.cat(segments)]
        ids = [torch.cat(ids)]
    extra = (
        row_inputs(
            model.config,
            pad_sequence(positions, True),
            pad_sequence(segments, True, -1),
            documents,
        )
        if row_inputs
        else {}
    )
    logps = (
        model(input_ids=pad_sequence(ids, True), use_cache=False, **extra)
        .logits.float()
        .log_softmax(-1)
    )
    sums = []
    # Where a row starts: its own line, or packed, after the rows before it.
    offset = 0
    for b, row in enumerate(rows):
        line = 0 if packed else b
        start = offset + len(row[0])
        for response in row[1:]:
            at = [offset + len(row[0]) - 1, *range(start, start + len(response) - 1)]
            sums.append(logps[line, at, response].sum())
            start += len(response)
        if packed:
            offset = start
    return torch.stack(sums)
