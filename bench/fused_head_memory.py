"""Peak memory of the fused output layer's backward (logps._TokenLogps through a (V, H) weight), on
the CPU: the bytes of the tensors that the backward's torch ops make, alive at once at their peak
(the returned gradients included), counted by a TorchDispatchMode, so the figure does not depend on
the allocator. Run from the repo root; each git revision named is measured too, from its loss.py:

    python bench/fused_head_memory.py cd5d119  # cd5d119: the commit before the vocabulary blocks

V = 32000, H = 1024, N = 512 scored tokens. The float32 chunk budget (logps._chunk_rows) is cut from
2**26 to 2**22 elements for every version measured, so that 512 tokens make several chunks, as
thousands do under the full budget at V = 128k."""

import os
import subprocess
import sys
import time
import types
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

V, H, N, BUDGET = 32000, 1024, 512, 2**22
MiB = 2**20


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops make (not those they write into or view), alive at once."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak, self.at_peak = {}, 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_args = tree_flatten((args, kwargs))[0]
        inputs = {a.untyped_storage().data_ptr() for a in flat_args if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key in self.live:
                self.live[key][1] += 1  # one more tensor on a storage made here
            elif key in inputs:
                continue  # written in place, or a view of a storage made before
            else:
                self.live[key] = [t.untyped_storage().nbytes(), 1, f"{t.dtype} {tuple(t.shape)}"]
                self.now += self.live[key][0]
                if self.now > self.peak:
                    self.peak = self.now
                    self.at_peak = sorted((n, what) for n, _, what in self.live.values())
            weakref.finalize(t, self.drop, key)
        return out

    def drop(self, key):
        self.live[key][1] -= 1
        if self.live[key][1] == 0:
            self.now -= self.live.pop(key)[0]


def load(rev):
    """The output layer's file of a git revision (None: the working tree's) as a module of its own:
    logps.py, or loss.py before the log-prob machinery had a file of its own."""
    names = subprocess.check_output(["git", "ls-tree", "--name-only", rev or "HEAD"], text=True)
    name = "logps.py" if "logps.py" in names.split() else "loss.py"
    if rev is None:
        source = open("logps.py").read()
    else:
        source = subprocess.check_output(["git", "show", f"{rev}:{name}"], text=True)
    module = types.ModuleType(f"loss_{rev or 'tree'}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"loss.py@{rev or 'tree'}", "exec"), module.__dict__)
    module._chunk_rows = chunk_rows
    return module


def chunk_rows(vocab, device, matmul=False):
    """_chunk_rows under the smaller budget."""
    return max(1, BUDGET // vocab)


def measure(loss, dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.05).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    out = loss._TokenLogps.apply(h, None, targets, w, False)
    mode, start = LiveBytes(), time.perf_counter()
    with mode:
        out.sum().backward()
    seconds = time.perf_counter() - start
    big = [what for n, what in mode.at_peak if n >= V * H * 2]
    return mode.peak, big, seconds


sys.path.insert(0, os.getcwd())
torch.manual_seed(0)
print(
    f"V={V} H={H} N={N}, chunk budget {BUDGET} elements; a float32 (V, H) is {V * H * 4 / MiB} MiB"
)
for rev in [*sys.argv[1:], None]:
    loss = load(rev)
    for dtype in (torch.float32, torch.bfloat16):
        peak, big, seconds = measure(loss, dtype)
        print(
            f"{rev or 'working tree'} {str(dtype):14} backward peak {peak / MiB:7.1f} MiB "
            f"({seconds:.2f} s); (V, H)-sized at the peak: {', '.join(big)}"
        )
