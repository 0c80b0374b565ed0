"""Where the fast backends' float32 logits part from the reference backends' on a full-size
random Qwen3.5 (tests/test_models_gpu.py::test_full_size_qwen3_5_fast_backends_match_reference):
per seed, the relative error of (a) all fast backends, (b) the same with the GDN layers' input
projections made contiguous (rules out the strided views of the fused in_proj), (c) fast but the
GDN prefill on the reference (float32 throughout: fla's chunk kernels multiply in TF32).

    python -m mstar.bench.tools.fast_vs_reference_probe --seeds 1 2 3
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

# the checkout's tests/ (its helpers are not installed): run from a checkout
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [os.path.join(ROOT, "tests")]

from hf_models import random_tokens  # noqa: E402
from model_harness import rel_err  # noqa: E402
from test_models_gpu import prefill_decode_logits  # noqa: E402

from mstar import knobs  # noqa: E402
from mstar.models import load_model  # noqa: E402
from mstar.models.qwen3_5.model import GatedDeltaNet  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-0.8b")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = ap.parse_args()
    lengths = [3, 40, 130]
    for seed in args.seeds:
        model = load_model(args.model, dtype=torch.float32, device="cuda", random_weights=True, seed=seed)
        seqs = {i: random_tokens(n + 2, model.config.vocab_size, 20 + i) for i, n in enumerate(lengths)}

        def run():
            return prefill_decode_logits(model, seqs, lengths)

        fast = run()
        with knobs.override(MSTAR_BACKENDS="*=reference"):
            ref = run()
        pre = GatedDeltaNet.pre
        GatedDeltaNet.pre = lambda self, x: tuple(t.contiguous() for t in pre(self, x))
        contig = run()
        GatedDeltaNet.pre = pre
        with knobs.override(MSTAR_BACKENDS="gdn_prefill=reference,gdn_prefill_fused=composed"):
            no_fla = run()
        print(f"seed {seed}: rel err fast {rel_err(fast, ref):.2e}, contiguous in_proj views "
              f"{rel_err(contig, ref):.2e} (vs fast {rel_err(contig, fast):.1e}), GDN prefill on the reference "
              f"{rel_err(no_fla, ref):.2e}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
