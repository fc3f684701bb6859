"""The planner: measure a model's costs, predict every layout and schedule on a virtual clock, choose.

    python -m lightning_parallel.plan --config examples/configs/demo.yaml --cli examples.train:CLI --devices 2

:func:`~lightning_parallel.plan.profile.profile` measures, :func:`~lightning_parallel.plan.predict.candidates`
ranks, :mod:`lightning_parallel.plan.output` writes the LightningCLI YAML of a plan and draws it.
"""

from lightning_parallel.plan.costs import BlockCosts, ExpertCosts, HelixCosts, combine
from lightning_parallel.plan.hardware import GPUS, LINKS, Gpu, Link, published_costs
from lightning_parallel.plan.predict import Layout, Prediction, Problem, candidates, predict
from lightning_parallel.plan.profile import profile

__all__ = [
    "GPUS",
    "LINKS",
    "BlockCosts",
    "ExpertCosts",
    "HelixCosts",
    "Gpu",
    "Layout",
    "Link",
    "Prediction",
    "Problem",
    "candidates",
    "combine",
    "predict",
    "profile",
    "published_costs",
]
