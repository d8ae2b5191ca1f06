"""Random-init Llama models for the benchmarks, saved as ordinary Hugging Face folders with the
byte-level ByT5 tokenizer, so nothing is downloaded. usage: python bench/make_model.py OUT_DIR SHAPE

    60m   hidden 512, 8 layers, 32000-row vocabulary (untied): 60.0M parameters, the CPU comparisons
    60m-4k  60m with 4096 positions: the packing bench's rows of up to 3,072 tokens
    270m  hidden 1024, 16 layers, 32000-row vocabulary (untied): 271.1M parameters, 1.08 GB in
          float32
    1b    the Llama-3.2-1B shape: hidden 2048, 16 layers, GQA 32/8 heads, 128256-row vocabulary
          (tied): 1.24B
"""

import sys

import torch
import transformers

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocabulary, tied, max positions
    "60m": (512, 1536, 8, 8, 8, 32000, False, 2048),
    "60m-4k": (512, 1536, 8, 8, 8, 32000, False, 4096),
    "270m": (1024, 2816, 16, 16, 16, 32000, False, 2048),
    "1b": (2048, 8192, 16, 32, 8, 128256, True, 4096),
}

out, shape = sys.argv[1], sys.argv[2]
hidden, inter, layers, heads, kv, vocab, tied, positions = SHAPES[shape]
tokenizer = transformers.ByT5Tokenizer()
config = transformers.LlamaConfig(
    vocab_size=vocab,
    hidden_size=hidden,
    intermediate_size=inter,
    num_hidden_layers=layers,
    num_attention_heads=heads,
    num_key_value_heads=kv,
    max_position_embeddings=positions,
    tie_word_embeddings=tied,
    rope_theta=500000.0 if shape == "1b" else 10000.0,
    bos_token_id=None,
    eos_token_id=tokenizer.eos_token_id,
    pad_token_id=tokenizer.pad_token_id,
)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params")
model.save_pretrained(out)
tokenizer.save_pretrained(out)
