"""The error a failed training update raises on every process."""


class TrainingError(RuntimeError):
    """An update failed (non-finite loss, neighbor-list overflow, a failed
    simulation, replicas that diverged).

    The failed update was not applied: the trainer keeps the last good state,
    and an error-state file was written for diagnosis where possible.
    """
