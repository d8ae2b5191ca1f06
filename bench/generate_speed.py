"""Generated tokens per second on one unsharded model, the same prompts, K and lengths, in
interleaved rounds: generate.py's sampler (each prompt prefilled once, its cache repeated for its K
samples), the same sampler with each prompt repeated K times before the prefill (what
num_return_sequences does), and Hugging Face's model.generate(num_return_sequences=K,
do_sample=True). Every completion runs to NEW tokens (EOS never stops it), so all three generate
alike. From the repo root:

    python bench/generate_speed.py MODEL PROMPT_TOKENS [K=4] [NEW=64] [PROMPTS=8] [ROUNDS=3]
"""

import os
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import generate  # noqa: E402

model_dir, prompt_len = sys.argv[1], int(sys.argv[2])
k, new, n, rounds = [int(x) for x in (sys.argv[3:] + ["4", "64", "8", "3"][len(sys.argv) - 3 :])]
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
prompts = torch.randint(3, model.config.vocab_size, (n, prompt_len)).tolist()
tokens = n * k * new


def prefilled_once() -> None:
    generate.generate(model, prompts, new, -1, 0, 1.0, 0, None, 1.0, k)


def prompt_repeated() -> None:
    generate.generate(model, [p for p in prompts for _ in range(k)], new, -1, 0, 1.0)


@torch.no_grad()
def hugging_face() -> None:
    model.generate(
        torch.tensor(prompts),
        attention_mask=torch.ones(n, prompt_len, dtype=torch.long),
        do_sample=True,
        num_return_sequences=k,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=0,
    )


runs = {
    "prefilled once": prefilled_once,
    "prompt repeated K times": prompt_repeated,
    "model.generate": hugging_face,
}
seconds = {name: [] for name in runs}
for _ in range(rounds):
    for name, fn in runs.items():
        t0 = time.perf_counter()
        fn()
        seconds[name].append(time.perf_counter() - t0)
threads = torch.get_num_threads()
print(f"{prompt_len}-token prompts, K = {k}, {new} new tokens, {n} prompts, {threads} threads")
for name, times in seconds.items():
    best = min(times)
    print(f"  {name:24s} {tokens / best:8.0f} tokens/s (best of {rounds}: {best:.2f} s)")
