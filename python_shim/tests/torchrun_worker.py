"""One rank of the torchrun end-to-end test (``test_torchrun.py``); not a test module itself.

Run as ``torchrun --standalone --nproc_per_node=2 torchrun_worker.py OUT BASE_PORT``. Each rank
installs stepalloc on its own simulated device (one device per process, as a job with one GPU
per rank), serves metrics on ``BASE_PORT + LOCAL_RANK``, trains a small DDP model on the CPU
(gloo) for a few steps with step markers, and allocates each step's device-side buffers
through stepalloc (kernels cannot run on a simulated device: the model stays on the CPU). It
then writes its snapshot, its Prometheus target and its figures under OUT, gathers every
rank's figures to rank 0, says it is ready and keeps its endpoint up until OUT/done appears.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import stepalloc

MIB = 1 << 20
STEPS = 4
# How long a rank waits for the test to finish scraping (the test itself gives up sooner).
WAIT_S = 80


def main() -> None:
    out = Path(sys.argv[1])
    base_port = int(sys.argv[2])
    handle = stepalloc.install(conf="backend:sim,sim_capacity_mb:2048,trace_entries:512", metrics_port=base_port)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    info = stepalloc.rank_info()
    assert info.rank == rank and info.local_rank == int(os.environ["LOCAL_RANK"]), info
    # One simulated device per process: every rank's device is its own device 0.
    assert handle.device == 0 and stepalloc.device_count() == 1, handle

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches, as a sampler gives
    for step in range(STEPS):
        with stepalloc.step("train"):
            # The step's device-side buffers: activations that grow with the step and differ by
            # rank (rank 1's are larger), so each rank has its own peaks.
            sizes = [(rank + 1) * (8 + 4 * step) * MIB, 3 * MIB + 4096 * rank]
            buffers = [stepalloc.raw_alloc(n, device=handle.device) for n in sizes]
            x = torch.randn(8, 16, generator=data)
            y = torch.randn(8, 1, generator=data)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over the ranks (gloo)
            optimizer.step()
            for ptr, n in zip(buffers, sizes):
                stepalloc.raw_free(ptr, n, device=handle.device)

    # DDP kept the replicas equal: the weights are the same on every rank.
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(replicas, weights)
    assert all(torch.equal(r, weights) for r in replicas), "DDP replicas differ"

    stepalloc.dump_snapshot(out / f"snapshot-rank{rank}.pickle")
    stepalloc.write_prometheus_targets(out / "targets")
    gathered = stepalloc.gather_stats()
    if rank == 0:
        (out / "gathered.json").write_text(json.dumps(gathered))
    else:
        assert gathered is None, gathered
    own = {
        "rank": rank,
        "installation_device": handle.device,
        "metrics_address": handle.metrics_address,
        "memory_stats": dict(stepalloc.memory_stats()),
        "summary": stepalloc.memory_summary(),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(own))
    (out / f"ready-rank{rank}").write_text("ready\n")

    deadline = time.monotonic() + WAIT_S
    while not (out / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
