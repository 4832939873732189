"""The loop's pictures: the spread along each MD run, and errors and labels per round."""
from __future__ import annotations


def test_rmse(trained) -> float | None:
    """The test force RMSE (eV/Angstrom) of a round's ``trained.json``, None without a test set."""
    if not trained or trained.get("test_set") != "testing":
        return None
    return trained["after"]["force_eV_per_A"]["RMSE"]


def plot_spread(path: str, records: list, threshold: float, record_every: int) -> None:
    """The score of every recorded frame along each run, with the threshold."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for j, rec in enumerate(records):
        steps = [i * record_every for i in range(len(rec["scores"]))]
        ax.plot(steps, rec["scores"], lw=1, label=f"run {j} ({rec['temperature_K']:g} K)")
    ax.axhline(threshold, color="k", ls="--", lw=1, label="threshold")
    ax.set_xlabel("MD step")
    ax.set_ylabel("largest atom's force spread (eV/Å)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_rounds(path: str, summaries: list) -> None:
    """Labels in all and, with a test set, the test force RMSE per round."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rounds = [s["round"] for s in summaries]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(rounds, [s["labels"] for s in summaries], color="0.8", label="labels")
    ax.set_xlabel("round")
    ax.set_ylabel("labels in the training set")
    errors = [(s["round"], test_rmse(s.get("trained"))) for s in summaries]
    errors = [(k, e) for k, e in errors if e is not None]
    if errors:
        twin = ax.twinx()
        twin.plot(*zip(*errors), "o-", color="C0")
        twin.set_ylabel("test force RMSE (eV/Å)", color="C0")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
