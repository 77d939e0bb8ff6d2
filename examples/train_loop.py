"""Your own training loop on fourfold's engine, under any layout: torchrun starts the ranks, the loop is yours.

    cd examples
    python train_loop.py                                                     # one process
    torchrun --nproc-per-node 2 --rdzv-backend fourfold-loopback --rdzv-endpoint 127.0.0.1:0 train_loop.py
    torchrun --nproc-per-node 4 --rdzv-backend fourfold-loopback --rdzv-endpoint 127.0.0.1:0 \\
        train_loop.py --tp 2 --pp 2                                          # dp = 4 / (tp * pp) = 1

(``fourfold-loopback`` keeps torchrun's store on 127.0.0.1; ``--standalone`` works too, listening on every
interface.) It trains ``my_model.py`` on the built-in corpus with warm-up and cosine decay, clips the gradients
by the whole model's norm, reports a held-out loss, and saves the unsharded weights. Every layout prints the
same losses as one process (float32 rounding aside): ``tests/test_examples.py`` checks that.
"""

from __future__ import annotations

import argparse

import torch
from my_model import build

from fourfold import Layout, launch, parallelize
from fourfold.data import BatchLoader, load_corpus
from fourfold.run.optim import learning_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save", default=None, help="write the unsharded weights here (rank 0)")
    args = parser.parse_args()
    with launch.init() as ctx:  # torchrun's environment, or one process
        layout = Layout(tp=args.tp, pp=args.pp, microbatches=2)  # every parallel setting; dp: the ranks left
        ranks = layout.mesh(ctx.world_size).build()
        loader = BatchLoader(load_corpus(max_bytes=2**20), batch_size=16, seq_len=32, seed=0,
                             dp_rank=ranks.coord.dp, dp_size=ranks.mesh.dp, eval_batches=1)  # 1 batch held out
        torch.manual_seed(0)  # the same model on every rank: tp and pp keep each rank's part of its own
        model = build(width=32, layers=4, seq_len=32)
        first, _ = loader.shard(0)
        engine = parallelize(model, ranks, layout, plan=model.fourfold_tp_plan, split=model.fourfold_split,
                             example=first[:1])  # a pipeline's split is checked on the example
        opt = torch.optim.AdamW(engine.parameters(), lr=3e-3)
        for step in range(1, args.steps + 1):
            x, y = loader.shard(step - 1)  # this rank's rows of the global batch
            loss = engine.step(x.to(ctx.device), y.to(ctx.device))  # forward, backward, micro-batches, sync
            norm = engine.clip_grad_norm_(1.0)  # the whole model's norm, the same on every rank
            for group in opt.param_groups:
                group["lr"] = learning_rate(step, lr=3e-3, steps=args.steps, warmup_steps=5, decay="cosine",
                                            min_lr=3e-4)
            opt.step()
            opt.zero_grad(set_to_none=True)
            value = loss.item()  # the global batch's mean loss
            if ctx.is_main:
                print(f"step {step} loss {value:.6f} grad_norm {norm:.4f}", flush=True)
        held = loader.eval_batch(0)
        value = engine.evaluate(held.inputs.to(ctx.device), held.targets.to(ctx.device)).item()
        state = engine.state_dict()  # unsharded, the model's own names (a collective: every rank calls it)
        if ctx.is_main:
            print(f"held-out loss {value:.6f}", flush=True)
            if args.save:
                torch.save(state, args.save)


if __name__ == "__main__":
    main()
