"""Hugging Face causal LMs to train: the built-in tiny model, or a hub id or folder, read and
written one tensor at a time so that no process holds the whole model.

Copyable on its own: imports only the standard library, torch and transformers.

    config = load_model_config("tiny", tokenizer)  # small files: on every rank
    model = build_model(config)  # parameters on the meta device, buffers computed on CPU
    weights = open_weights("tiny", config, seed=0)  # {name: CPU tensor}; files memory-mapped
    # entries: (name, tensor, fetch); rank 0 writes
    save_pretrained("final", model, entries, torch.bfloat16)
    key = model_identity("tiny", config, seed=0)  # what fixes its weights, for cache keys
"""

import contextlib
import glob
import json
import os

import torch
import torch.distributed as dist
import transformers
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
    build time, in no weight file."""
    with _parameters_on_meta():
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@contextlib.contextmanager
def _parameters_on_meta():
    """Inside, every parameter a module registers is moved to the meta device as it is registered,
    before the layer initializes it, while buffers are made as usual, on the CPU: what accelerate's
    init_empty_weights(include_buffers=False) does. (Under torch.device("meta"), computed buffers
    such as rotary tables would be on meta too, and lost.) It replaces
    torch.nn.Module.register_parameter, for every module, until the block ends."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        # A tie registers a parameter that is on meta already: it must stay that same parameter.
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


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
    random init from `seed`."""
    if name == "tiny":
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.float32
        ).state_dict()
    # Under the files' names: transformers may rename or fuse them for the model.
    weights = {}
    for path in find_weights(name):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        # The file's own notes, not a tensor.
        header.pop("__metadata__", None)
        # The whole file as bytes, memory-mapped; the tensors' data starts after the header.
        file = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
        data = file[8 + size :]
        for key, meta in header.items():
            begin, end = meta["data_offsets"]
            dtype = _DTYPES[meta["dtype"]]
            # A typed view needs aligned bytes, which writers other than this one need not give:
            # then a copy.
            piece = data[begin:end].clone() if begin % dtype.itemsize else data[begin:end]
            weights[key] = piece.view(dtype).view(meta["shape"])
    return _converted_for(build_model(config), weights)


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
    total = 0
    for group, saved in groups:
        nbytes = sum(t.numel() * t.dtype.itemsize for t in saved.values())
        if files[-1] and size + nbytes > _FILE_BYTES:
            files.append([])
            size = 0
        files[-1].append((group, saved))
        size += nbytes
        total += nbytes
    os.makedirs(folder, exist_ok=True)
    # An earlier export's files go, which may be split otherwise.
    for old in glob.glob(os.path.join(folder, "model*.safetensors*")):
        os.remove(old)
    # The export's dtype, not the float32 masters'; and the class vLLM builds, not FSDP2's.
    model.config.dtype = dtype
    model.config.architectures = [type(plain).__name__]
    model.config.save_pretrained(folder)
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
                    "data_offsets": [offset, offset + tensor.numel() * tensor.dtype.itemsize],
                }
                offset = header[name]["data_offsets"][1]
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
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _saved_groups(plain: torch.nn.Module, entries: list, dtype: torch.dtype) -> list:
    """`entries` grouped as save_pretrained of the `plain` model converts them back to the layout
    transformers loads (GPT-NeoX's lm_head as embed_out; a layer's stacked experts as one tensor per
    expert and projection), which older transformers, vLLM and other tools read: [(entries, {saved
    name: meta tensor, floats in `dtype`})], the entries of a group fetched together."""
    mapping = conversion_mapping.get_model_conversion_mapping(plain, add_legacy=False)
    reverse = [
        t.reverse_transform()
        for t in mapping[::-1]
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
