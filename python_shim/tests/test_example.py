"""The agent-loop example: its model is right (on CPU), and it runs or says it needs a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import SHIM, torch_available

EXAMPLE = SHIM / "examples" / "agent_loop.py"
pytestmark = pytest.mark.skipif(not torch_available(), reason="torch is not installed: the example not run")


def test_cached_generation_matches_a_full_forward_pass() -> None:
    import torch

    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import agent_loop
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    torch.manual_seed(0)
    model = agent_loop.TinyLM(vocab=256, dim=64, heads=4, layers=2, context=64)
    prompt_len = 8
    seq = agent_loop.rollout(model, torch.randint(0, 256, (3, prompt_len)), 12)
    assert seq.shape == (3, prompt_len + 12)
    with torch.no_grad():
        full = model(seq[:, :-1])
        caches: list = [[] for _ in model.blocks]
        steps = [model(seq[:, :prompt_len], 0, caches)[:, -1]]
        for i in range(prompt_len, seq.shape[1] - 1):
            steps.append(model(seq[:, i : i + 1], i, caches)[:, -1])
    assert torch.allclose(full[:, prompt_len - 1 :], torch.stack(steps, 1), atol=1e-4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    loss = agent_loop.train_step(model, optimizer, seq, prompt_len)
    assert loss == loss  # not NaN
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), "the step changed the weights"


def test_example_runs_on_a_gpu_or_says_it_needs_one() -> None:
    import torch

    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--iterations", "2", "--batch", "4"],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if torch.cuda.is_available():
        assert run.returncode == 0, run.stdout + run.stderr
        assert "stepalloc" in run.stdout and " rollout " in run.stdout and " train " in run.stdout
    else:
        assert run.returncode == 1
        assert "This example needs a CUDA GPU" in run.stderr
