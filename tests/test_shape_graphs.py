"""ShapeGraphs' input loading (models/shape_graphs.py): leaves before constant_from are copied into
the graph's static inputs at every replay; a constant leaf only when a different tensor object comes
in its place, or when the one copied last is gone (weak references: the graph keeps no request's
memory alive). The replay itself is CUDA-only (tests/test_cosmos3_gpu.py, test_wan_transformer.py)."""

from __future__ import annotations

import gc

import torch

from mstar.models.shape_graphs import ShapeGraphs, _Captured


def test_constant_leaves_are_copied_only_when_they_change():
    x, t, text = torch.randn(3), torch.randn(2), torch.randn(4)
    graphs = ShapeGraphs(lambda *a: a[0], constant_from=2)
    args = (x, t, text)
    leaves = [x, t, text]
    assert graphs._variable_leaves(args, leaves) == 2
    got = _Captured(None, [a.clone().zero_() for a in leaves], None)
    assert got.load(leaves, 2) == 3 and all(torch.equal(a, b) for a, b in zip(got.inputs, leaves))
    x2 = torch.randn(3)
    assert got.load([x2, t, text], 2) == 2 and torch.equal(got.inputs[0], x2)  # the same text: not copied
    text2 = torch.randn(4)
    assert got.load([x2, t, text2], 2) == 3 and torch.equal(got.inputs[2], text2)
    assert got.load([x2, t, text2], 2) == 2
    del text2
    gc.collect()
    text3 = torch.randn(4)  # a new tensor (its id may be the freed one's): copied
    assert got.load([x2, t, text3], 2) == 3 and torch.equal(got.inputs[2], text3)


def test_without_constant_from_every_leaf_is_copied():
    leaves = [torch.randn(2), [torch.randn(1), torch.randn(3)]]
    graphs = ShapeGraphs(lambda *a: a[0])
    flat = [leaves[0], *leaves[1]]
    assert graphs._variable_leaves(tuple(leaves), flat) == 3
    got = _Captured(None, [a.clone() for a in flat], None)
    assert got.load(flat, 3) == 3 and got.load(flat, 3) == 3


def test_constant_from_counts_nested_leaves():
    graphs = ShapeGraphs(lambda *a: a[0], constant_from=2)
    args = (torch.randn(1), [torch.randn(1), torch.randn(1)], torch.randn(1), torch.randn(1))
    assert graphs._variable_leaves(args, [None] * 5) == 3
