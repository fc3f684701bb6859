"""Export a sharded lightning-parallel checkpoint as one plain Lightning checkpoint file.

    python -m lightning_parallel.export CHECKPOINT_DIR OUT.ckpt

The output holds the full model under its original parameter names, each optimizer's state in the
positional form of the original ``configure_optimizers`` groups, and the rest of Lightning's checkpoint:
``MyModule.load_from_checkpoint("OUT.ckpt")`` and ``Trainer(...).fit(..., ckpt_path="OUT.ckpt")`` work
without lightning-parallel installed.
"""

from __future__ import annotations

import argparse
import sys

from lightning_parallel.checkpoint import export
from lightning_parallel.errors import CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_parallel.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint_dir", help="a directory written by a lightning-parallel strategy")
    parser.add_argument("out_file", help="the plain .ckpt file to write")
    args = parser.parse_args(argv)
    try:
        export(args.checkpoint_dir, args.out_file)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
