"""LoRA through peft: low-rank adapters train while the base model stays frozen, and the base model
itself (the adapters switched off) is DPO's reference, so LoRA DPO holds one model's weights, not
two. Copyable on its own: imports only the standard library and torch; peft when adapters are asked
for.

    # a peft model: only the adapters train
    model = add_adapters(model, LoraConfig(lora_rank=16), block_class)
    reference = WithoutAdapters(model)  # the base model: peft's disable_adapter() per call
    save_adapters(model, folder, adapters, base_model)  # rank 0: a peft adapter folder
    # by the peft model's names: what to load, adapters too
    weights = initial_weights(model, base_weights)
    # W + (alpha / rank) B A, under the base model's names
    merged = merged_entries(model, entries)
    base = base_entries(entries)  # W alone, under the base model's names

The adapters need peft and a Hugging Face model; the names between a peft model and its base model
need neither. This runs as written:

    import torch
    from lora import LoraConfig, base_entries

    try:  # a rank above 0 also checks that peft is installed
        LoraConfig(lora_rank=0, export_merged=True)
    except ValueError as e:
        print(e)
    # A peft Llama's tensors as fsdp_setup.full_tensors gives them: (name, tensor, fetch)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    names = [f"{q}.base_layer.weight", f"{q}.lora_A.default.weight", f"{q}.lora_B.default.weight"]
    names.append("base_model.model.lm_head.weight")
    # Each one's (sharded) tensor; fetch() gathers it whole.
    weight = torch.zeros(8, 8, device="cpu")
    entries = [(name, weight, weight.clone) for name in names]
    # The base model's weights under its own names, the adapters dropped: W alone.
    print([name for name, _, _ in base_entries(entries)])
"""

import functools
import importlib.util
import warnings
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LoraConfig:
    lora_rank: int = 0
    """LoRA: train rank-R adapters (through peft) on --lora-targets, the base weights frozen in the
    compute dtype; the reference is the same model with its adapters off, not a second copy. 0: full
    fine-tuning."""
    lora_alpha: float = 16.0
    """Adapter scale: an adapted weight is W + (alpha / rank) B A."""
    lora_targets: tuple[str, ...] = ()
    """Modules to adapt, as peft's target_modules: a name matches itself and every module path
    ending in ".name" (q_proj v_proj). Default: every linear layer inside the transformer blocks."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input; off by default, like the model's own. Needs --dropout (train
    mode)."""
    export_merged: bool = False
    """With --lora-rank: export {out_dir}/final as a Hugging Face model with the adapters merged
    into its weights, instead of a peft adapter folder. The base is merged as held: with --precision
    bf16 or fp16, its weights rounded to that dtype (for float32 ones, merge the adapter folder into
    a float32 base with peft)."""

    def __post_init__(self):
        if self.lora_rank < 0:
            raise ValueError(f"--lora-rank must be >= 0, got {self.lora_rank}")
        if not 0 < self.lora_alpha < float("inf"):
            raise ValueError(f"--lora-alpha must be > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.export_merged and not self.lora_rank:
            raise ValueError(
                "--export-merged needs --lora-rank (full fine-tuning always exports merged weights)"
            )
        # The one check; peft is imported lazily where it is used.
        if self.lora_rank and importlib.util.find_spec("peft") is None:
            raise ValueError("--lora-rank needs the peft package: pip install peft")


def add_adapters(
    model: nn.Module, config: LoraConfig, block_class: type[nn.Module], seed: int = 0
) -> nn.Module:
    """`model` (a Hugging Face causal LM) as a peft model with LoRA adapters on config.lora_targets
    (default: every nn.Linear in a `block_class` module), all else frozen. The adapters are made on
    the CPU whatever the base's device (the meta device too), as peft initializes them (B zero: the
    model computes what it did), drawn from `seed`; every global generator (CPU, CUDA) is left as it
    was."""
    import peft

    targets = list(config.lora_targets) or _block_linears(model, block_class)
    lora = peft.LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        # A sequence classifier (a reward model) is a plain peft model: its head trains whole, as
        # the caller sets it, under its own name.
        task_type=None if model.get_output_embeddings() is None else "CAUSAL_LM",
    )
    # peft draws from the global CPU generator (restored on exit), seeded alone: torch.manual_seed
    # would also reseed every CUDA generator, which fork_rng(devices=[]) does not restore, changing
    # the run's dropout and sampling.
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.default_generator.manual_seed(seed)
        # A warning about peft's own use of a renamed transformers attribute: nothing the user can
        # act on.
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
        )
        try:
            model = peft.get_peft_model(model, lora)
        # peft's "Target modules {...} not found in the base model", as one line.
        except ValueError as e:
            raise ValueError(
                f"--lora-targets {' '.join(targets)}: {str(e).splitlines()[0]}"
            ) from None
        if isinstance(model.get_output_embeddings(), peft.tuners.lora.LoraLayer):
            raise ValueError("--lora-targets: the output layer takes no adapters here")
        for name, module in model.named_modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                # merged_entries folds linear layers' adapters only: refused now, not at export.
                if config.export_merged and not isinstance(module, peft.tuners.lora.Linear):
                    raise ValueError(
                        "--export-merged merges adapters on linear layers only; "
                        f"{name.removeprefix('base_model.model.')} is a {type(module).__name__}"
                    )
                # peft made the adapters on the base's device (meta): made anew here, on the CPU.
                for layer in module.adapter_layer_names:
                    getattr(module, layer).to_empty(device="cpu")
                module.reset_lora_parameters("default", True)
    return model


def initial_weights(model: nn.Module, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What to load into the peft `model` (from add_adapters, e.g. on the meta device), by its own
    names: the adapters as drawn, and the `base` model's weights, given by the base model's
    names."""
    weights = {}
    for name, param in model.named_parameters():
        if ".lora_" in name:
            weights[name] = param.detach()
        elif _base_name(name) in base:
            weights[name] = base[_base_name(name)]
    return weights


def _base_name(name: str) -> str:
    """A peft model's tensor name as the Hugging Face model under it calls it."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _block_linears(model: nn.Module, block_class: type[nn.Module]) -> list[str]:
    """The names of the linear layers inside the blocks: their last name part (q_proj, ...), or
    their full paths where a linear layer outside the blocks shares one (peft would match it
    too)."""
    inside = {
        f"{name}.{sub}"
        for name, block in model.named_modules()
        if isinstance(block, block_class)
        for sub, m in block.named_modules()
        if isinstance(m, nn.Linear)
    }
    outside = {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name not in inside
    }
    short = {name.rsplit(".", 1)[-1] for name in inside}
    return sorted(short) if not short & outside else sorted(inside)


class WithoutAdapters:
    """A peft model with its adapters off, as DPO's reference: calls run it under peft's
    disable_adapter() in eval mode (no dropout, as a frozen copy would be); every other attribute is
    the model's own."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        trained = [p for p in self.model.parameters() if p.requires_grad]
        training = self.model.training
        with self.model.disable_adapter():
            # peft also sets the adapters' requires_grad to False in here. FSDP2 reads requires_grad
            # on its first forward to pick each group's gradient reduce dtype, and finding no
            # trained weight it would keep bf16 gradients, which then cannot be assigned to the
            # float32 adapters: so put it back.
            for p in trained:
                p.requires_grad_(True)
            try:
                return self.model.eval()(*args, **kwargs)
            finally:
                self.model.train(training)

    def __getattr__(self, name):
        return getattr(self.model, name)


def merged_entries(model: nn.Module, entries: list) -> list:
    """fsdp_setup.full_tensors' (name, tensor, fetch) of the peft `model` as its Hugging Face
    model's: each adapted weight W fetched as W + (alpha / rank) B A in float32, under the base
    model's names; the adapters dropped."""
    import peft

    fetches = {name: fetch for name, _, fetch in entries}
    layers = {
        f"{name}.base_layer.weight": module
        for name, module in model.named_modules()
        if isinstance(module, peft.tuners.lora.Linear)
    }
    # Each adapted weight's fetch merges its adapters in; every other fetch is the entry's own.
    return base_entries(
        [
            (
                name,
                tensor,
                functools.partial(
                    _merged_weight, layers[name], name.removesuffix(".base_layer.weight"), fetches
                )
                if name in layers
                else fetch,
            )
            for name, tensor, fetch in entries
        ]
    )


def base_entries(entries: list) -> list:
    """fsdp_setup.full_tensors' (name, tensor, fetch) of a peft model as its base model's, under
    the base model's names: the adapters dropped, nothing merged."""
    return [(_base_name(name), t, fetch) for name, t, fetch in entries if ".lora_" not in name]


def _merged_weight(layer: nn.Module, prefix: str, fetches: dict) -> torch.Tensor:
    # Gathers, in the same order on every rank: A, B, then the base weight.
    a = fetches[f"{prefix}.lora_A.default.weight"]()
    b = fetches[f"{prefix}.lora_B.default.weight"]()
    delta = layer.scaling["default"] * (b.float() @ a.float())  # (out, in)
    # fan_in_fan_out: the layer holds its weight as (in, out).
    return fetches[f"{prefix}.base_layer.weight"]().float() + (
        delta.T if layer.fan_in_fan_out else delta
    )


def save_adapters(
    model: nn.Module, folder: str, adapters: dict[str, torch.Tensor], base_model: str
) -> None:
    """Write peft's adapter folder of the gathered `adapters` (on one rank), naming `base_model`
    (a hub id or folder that loads) as base."""
    model.peft_config["default"].base_model_name_or_path = base_model
    model.save_pretrained(folder, state_dict=adapters)
