"""The run around the engine: the ``Trainer`` and its Stateful components (LR
schedule, divergence detector, rollback controller, budget loop), signals, faults
and the ``--nproc`` launcher."""
