"""Train an example model with LightningCLI and a lightning-parallel strategy.

    python -m examples.train fit --config examples/configs/demo.yaml

Any Lightning flag works as usual, e.g. ``--trainer.max_steps=20`` or ``--trainer.strategy=hybrid``.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.cli import LightningCLI

import lightning_parallel  # noqa: F401  (registers the strategy names)


class PrintLoss(L.Callback):
    """Print the global batch's training loss every ``every_n_steps`` optimizer steps (global rank 0)."""

    def __init__(self, every_n_steps: int = 10) -> None:
        self.every_n_steps = every_n_steps

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step % self.every_n_steps == 0:
            # mean over the data-parallel replicas: the loss of the whole global batch
            loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")
            if trainer.is_global_zero:
                print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)


class CLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # the character vocabulary is known only once the corpus is read
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.block_size", "model.init_args.block_size")


def main() -> None:
    CLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True)


if __name__ == "__main__":
    main()
