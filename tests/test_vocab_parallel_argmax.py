"""parallel.vocab_parallel_argmax: the greedy token of vocab-sharded logits without gathering
them (overlapped decode's launch at tp > 1). Against torch.argmax of the whole row, on gloo in
2 and 3 processes: fresh random bf16 logits, a padded last shard (whose zero columns would win
over negative logits if they counted), and ties inside a shard and across shards (the lowest id
wins, as torch.argmax does)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mstar.models import parallel


def _cases(seed: int, vocab: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16)
    x[0] = -1.0 - torch.rand(vocab, generator=g)  # all negative: padding columns must not win
    x[1, 5] = x[1, vocab - 3] = x[1].max() + 1  # a tie across shards: id 5
    x[2, vocab - 2] = x[2, vocab - 1] = x[2].max() + 1  # a tie in the last (padded) shard
    x[3] = 0.5  # every id ties: id 0
    return x


def _rank(rank: int, size: int, init: str, seed: int, vocab: int, rows: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        full = _cases(seed, vocab, rows)
        width = -(-vocab // size)
        padded = torch.zeros(rows, width * size, dtype=full.dtype)  # the head's padding rows give 0
        padded[:, :vocab] = full
        local = padded[:, rank * width:(rank + 1) * width].contiguous()
        got = parallel.vocab_parallel_argmax(local, vocab, rank, size)
        torch.save(got, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size,vocab", [(2, 259), (3, 1000)])
def test_matches_argmax_of_the_whole_row(tmp_path, size, vocab):
    seed = int.from_bytes(os.urandom(4), "little")
    rows = 9
    out = str(tmp_path / "tokens")
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_rank, args=(size, init, seed, vocab, rows, out), nprocs=size, join=True)
    want = _cases(seed, vocab, rows).argmax(dim=-1)
    assert want[1] == 5 and want[2] == vocab - 2 and want[3] == 0
    for r in range(size):
        got = torch.load(f"{out}.{r}")
        assert got.dtype == torch.int64
        assert torch.equal(got, want), (seed, r, got, want)
