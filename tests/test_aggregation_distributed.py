"""Two gloo processes, each holding a shard of the batch and several micro-batches: the
all-reduced gradient equals the single-process full-batch gradient, for every mode."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollkit.losses import AGGREGATION_MODES, aggregate, global_normalizers

WORLD = 2
B, T = 7, 5  # shards of 4 and 3 rows: unequal token counts on purpose


def _data():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(B, T, generator=g)
    lens = torch.tensor([5, 1, 0, 3, 4, 2, 5])  # a fully masked row included
    mask = torch.arange(T) < lens[:, None]
    mask[0, 2] = False  # an interior hole
    weights = torch.rand(B, generator=g) * 2
    theta0 = torch.randn(T, generator=g)
    return x, mask, weights, theta0


def _loss(x, theta):
    return (x * theta).square() + x * theta


def _full_grad(mode, use_weights):
    x, mask, weights, theta0 = _data()
    theta = theta0.clone().requires_grad_()
    w = weights if use_weights else None
    aggregate(_loss(x, theta), mask, mode, weights=w, norm_length=T).backward()
    return theta.grad


def _worker(rank, port, out_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        x, mask, weights, theta0 = _data()
        rows = slice(0, 4) if rank == 0 else slice(4, B)
        x, mask, weights = x[rows], mask[rows], weights[rows]
        results = {}
        for mode in AGGREGATION_MODES:
            for use_weights in (False, True):
                w = weights if use_weights else None
                norms = global_normalizers(mask, w)  # collective: all-reduced counts
                assert norms["dp_size"] == WORLD
                for reduction in ("sum", "mean"):
                    theta = theta0.clone().requires_grad_()
                    kw = dict(norms) if reduction == "mean" else {**norms, "dp_size": 1}
                    n = mask.shape[0]
                    for lo in range(0, n, 2):  # micro-batches of 2 rows
                        mb = slice(lo, lo + 2)
                        wm = None if w is None else w[mb]
                        aggregate(
                            _loss(x[mb], theta), mask[mb], mode, weights=wm, norm_length=T, **kw
                        ).backward()
                    g = theta.grad.clone()
                    dist.all_reduce(g, op=dist.ReduceOp.SUM)
                    if reduction == "mean":  # what DDP does
                        g /= WORLD
                    results[(mode, use_weights, reduction)] = g
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "grads.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sharded_gradient_equals_single_process_gradient(tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    results = torch.load(tmp_path / "grads.pt")
    assert len(results) == len(AGGREGATION_MODES) * 4
    for (mode, use_weights, reduction), g in results.items():
        expected = _full_grad(mode, use_weights)
        assert torch.allclose(g, expected, rtol=1e-5, atol=1e-6), (mode, use_weights, reduction)
        assert g.abs().sum() > 0


def test_global_normalizers_without_distributed_are_local():
    _, mask, weights, _ = _data()
    n = global_normalizers(mask, weights)
    assert n["dp_size"] == 1
    assert torch.isclose(n["num_tokens"], (weights.double() * mask.sum(-1)).sum())
    assert torch.isclose(n["num_seqs"], weights.double()[mask.any(-1)].sum())
