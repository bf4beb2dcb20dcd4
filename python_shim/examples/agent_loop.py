"""An agent loop on a real (small) model with stepalloc: rollout, then training, repeated.

Each iteration:
  * rollout: generate tokens under ``torch.no_grad()`` with a KV cache that grows one token at
    a time (every step allocates a slightly larger cache: the classic fragmentation pattern);
  * train: score the rollouts, run forward + backward + an optimizer step on them.
The two phases want memory in very different shapes. stepalloc is told where each phase
begins and ends (``AgentLoop.rollout()`` / ``AgentLoop.train()``); with ``phase_trim:True`` the
rollout's cached blocks are handed back before training needs large contiguous ranges.

Needs a CUDA GPU and torch. Run it from the repository root after
``cargo build --release -p stepalloc-cabi``::

    python python_shim/examples/agent_loop.py --iterations 6
    python python_shim/examples/agent_loop.py --no-stepalloc      # PyTorch's allocator, to compare
    python python_shim/examples/agent_loop.py --snapshot loop.pickle   # open at pytorch.org/memory_viz
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

try:
    import stepalloc
except ImportError:  # run from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import stepalloc

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    sys.exit("This example needs PyTorch with CUDA: `pip install torch`, on a machine with an NVIDIA GPU.")

MIB = 1 << 20


class Attention(nn.Module):
    """Causal self-attention with an explicit, growing key/value cache."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if cache is not None:
            if cache:
                # Concatenation allocates a new, slightly larger cache every generated token.
                k = torch.cat([cache[0], k], dim=2)
                v = torch.cat([cache[1], v], dim=2)
            cache[:] = [k, v]
        causal = cache is None or t > 1
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A small decoder-only transformer (about 14M parameters with the defaults)."""

    def __init__(self, vocab: int = 4096, dim: int = 384, heads: int = 6, layers: int = 6, context: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, start: int = 0, caches: list[list[torch.Tensor]] | None = None):
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for i, block in enumerate(self.blocks):
            x = block(x, caches[i] if caches is not None else None)
        return self.head(self.ln(x))


@torch.no_grad()
def rollout(model: TinyLM, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Samples ``new_tokens`` tokens after ``prompts`` with a growing KV cache."""
    caches: list[list[torch.Tensor]] = [[] for _ in model.blocks]
    logits = model(prompts, 0, caches)
    out = [prompts]
    position = prompts.shape[1]
    for _ in range(new_tokens):
        token = torch.multinomial(F.softmax(logits[:, -1].float(), dim=-1), 1)
        out.append(token)
        logits = model(token, position, caches)
        position += 1
    return torch.cat(out, dim=1)


def reward(sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """A toy reward: the share of generated tokens that are even."""
    return (sequences[:, prompt_len:] % 2 == 0).float().mean(dim=1)


def train_step(model: TinyLM, optimizer: torch.optim.Optimizer, sequences: torch.Tensor, prompt_len: int) -> float:
    """One policy-gradient step (REINFORCE with a mean baseline) on the rollouts."""
    logits = model(sequences[:, :-1])
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, sequences[:, 1:, None]).squeeze(-1)
    advantage = reward(sequences, prompt_len)
    advantage = advantage - advantage.mean()
    loss = -(logp[:, prompt_len - 1 :].sum(dim=1) * advantage).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--conf", default="phase_trim:True,trace_entries:20000", help="stepalloc configuration")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    parser.add_argument("--snapshot", type=Path, default=None, help="write a memory-viewer snapshot here at the end")
    parser.add_argument("--no-stepalloc", action="store_true", help="use PyTorch's own allocator, to compare")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if not torch.cuda.is_available():  # does not initialise CUDA, so install() can still follow
        print(
            "This example needs a CUDA GPU: torch.cuda.is_available() is False on this machine. "
            "stepalloc's CPU-only parts (the simulated device, statistics, snapshots, the stress tool) "
            "are shown by python_shim/tests and stepalloc-stress instead.",
            file=sys.stderr,
        )
        return 1

    use_stepalloc = not args.no_stepalloc
    if use_stepalloc:
        # Before anything touches CUDA: every tensor below is allocated by stepalloc, and
        # torch.cuda.memory_stats()/max_memory_allocated() answer from it (patch_torch).
        handle = stepalloc.install(conf=args.conf, metrics_port=args.metrics_port, patch_torch=True)
        print(f"stepalloc {handle.version} installed from {handle.library_path} (conf {handle.conf!r})")

    torch.manual_seed(args.seed)
    device = torch.device("cuda")
    model = TinyLM().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters")

    loop = stepalloc.AgentLoop() if use_stepalloc else None
    generator = torch.Generator().manual_seed(args.seed)
    print(f"{'iter':>4} {'phase':<8} {'tokens':>6} {'peak alloc':>11} {'peak resv':>10} {'step frag':>9} {'ms':>7}")
    for it in range(args.iterations):
        # Variable shapes per iteration, as in real agent loops.
        prompt_len = int(torch.randint(16, 128, (1,), generator=generator))
        new_tokens = int(torch.randint(64, 384, (1,), generator=generator))
        prompts = torch.randint(0, 4096, (args.batch, prompt_len), device=device)
        for phase in ("rollout", "train"):
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            context = loop.phase(phase) if loop is not None else contextlib.nullcontext()
            with context:
                if phase == "rollout":
                    sequences = rollout(model, prompts, new_tokens)
                else:
                    train_step(model, optimizer, sequences, prompt_len)
                torch.cuda.synchronize()
            ms = (time.perf_counter() - start) * 1e3
            if loop is not None:
                r = loop.history[-1]
                peak_alloc, peak_resv, frag = r.peak_allocated_bytes, r.peak_reserved_bytes, r.step_fragmentation
            else:
                peak_alloc, peak_resv = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
                frag = 1 - peak_alloc / peak_resv if peak_resv else 0.0
            tokens = prompt_len + new_tokens
            print(
                f"{it:>4} {phase:<8} {tokens:>6} {peak_alloc / MIB:>8.0f} MiB {peak_resv / MIB:>6.0f} MiB "
                f"{frag:>9.3f} {ms:>7.0f}"
            )
        if loop is not None:
            loop.next_iteration()
        del sequences, prompts

    print(torch.cuda.memory_summary(abbreviated=True))
    if use_stepalloc and args.snapshot is not None:
        print(
            f"snapshot written to {stepalloc.dump_snapshot(args.snapshot)} (open it at https://pytorch.org/memory_viz)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
