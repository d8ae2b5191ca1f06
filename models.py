"""Hugging Face causal LMs to train: the built-in tiny model, or a hub id or folder; loaded whole on one rank.

Copyable on its own: imports only the standard library, torch and transformers.

    config = load_model_config("tiny", tokenizer)       # small files: on every rank
    model = load_full_model("tiny", config, seed=0)     # the whole float32 model on CPU: on rank 0
    key = model_identity("tiny", config, seed=0)        # what fixes its weights, for cache keys
"""

import os

import torch
import transformers


def load_model_config(name: str, tokenizer=None, max_length: int = 0) -> transformers.PretrainedConfig:
    """The config of "tiny" (a ~1M-parameter Llama over `tokenizer`'s vocabulary: trains on a laptop CPU, needs
    no files), a hub id or a local folder. Raises ValueError naming the flag when it cannot be read, or when the
    model has fewer positions than max_length."""
    if name == "tiny":
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    else:
        try:
            config = transformers.AutoConfig.from_pretrained(name)
        except OSError as e:
            raise ValueError(f"--model {name}: cannot load ({str(e).strip().splitlines()[0]})") from None
    positions = getattr(config, "max_position_embeddings", None)
    if positions and max_length > positions:
        raise ValueError(f"--max-length {max_length} exceeds the model's {positions} positions")
    return config


def load_full_model(name: str, config, seed: int) -> torch.nn.Module:
    """The whole float32 model on CPU: pretrained weights, or for "tiny" a random init from `seed`."""
    if name == "tiny":
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return transformers.AutoModelForCausalLM.from_pretrained(name, config=config, dtype=torch.float32)


def model_identity(name: str, config, seed: int) -> dict:
    """What fixes a model's initial weights: the seed for tiny; else the name, the hub commit, the weight files."""
    if name == "tiny":
        return {"tiny": seed, "config": config.to_dict()}
    folder = os.path.expanduser(name)
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []  # a hub id: its commit says it all
    files = [(f, os.path.getsize(os.path.join(folder, f)), os.path.getmtime(os.path.join(folder, f)))
             for f in names if f.endswith((".safetensors", ".bin"))]
    return {"name": name, "commit": getattr(config, "_commit_hash", None), "files": files}
