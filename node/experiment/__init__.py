"""`ftis-node experiment`: the paper's comparison of loss variants, run with the node's own code.

    from node.experiment import run_experiment
    results = run_experiment("runs/exp", pairs=["size"], seeds=[0, 1], dht_check=True)

`runner` plays the runs (pairs of `Node`s in lockstep on an in-process exchange, or on
real DHTs for the check), `evaluate` measures greedy pass@1, `report` writes the JSON,
the markdown tables and the plot.
"""

from node.experiment.runner import (
    BUILTIN_PAIRS,
    DEFAULT_VARIANTS,
    ExperimentConfig,
    NodeSpec,
    PairSpec,
    load_experiment_config,
    resolve_config,
    run_experiment,
    run_pair,
)

__all__ = [
    "BUILTIN_PAIRS",
    "DEFAULT_VARIANTS",
    "ExperimentConfig",
    "NodeSpec",
    "PairSpec",
    "load_experiment_config",
    "resolve_config",
    "run_experiment",
    "run_pair",
]
