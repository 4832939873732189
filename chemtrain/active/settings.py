"""The settings of an active-learning run: one plain value, written to the
run's folder so that a restart continues with the same ones."""
from __future__ import annotations

import dataclasses
import json

MODES = ("relative", "absolute")
SELECTIONS = ("diverse", "top", "random")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the loop does each round (units: K, fs, eV/Angstrom, Angstrom).

    Attributes:
      rounds: rounds of MD, labelling and retraining after the first training.
      labels_per_round: frames labelled per round (at most).
      ensemble_size: committee members.
      epochs_first, epochs_per_round: ``chemtrain-finetune`` epochs of the
        first committee (from scratch) and of each retraining (from the
        members' current parameters).
      finetune_args: further ``chemtrain-finetune`` flags (model sizes,
        learning rate, ...), the same every round.
      temperatures_K: one MD run per seed structure and temperature each round.
      md_steps, timestep_fs, friction_per_fs: each run's length and ASE
        Langevin's settings.
      record_every: steps between recorded (scored) frames.
      threshold, threshold_mode: a frame is uncertain when its score, the
        largest atom's committee force spread, passes ``threshold`` (eV/A,
        the spread times the calibrated scale) with ``'absolute'``; or
        ``threshold`` times the median score of the training set's
        structures with ``'relative'`` (the scale cancels: both sides carry it).
      stop_after: a run stops after this many uncertain frames (default:
        4 x ``labels_per_round``, so that there is a choice).
      max_force, min_distance, keep_sane: a run whose mean force passes
        ``max_force`` or whose atoms come closer than ``min_distance``
        (default: 0.7 times the shortest distance in the seed labels) has
        exploded; its last ``keep_sane`` recorded frames go to labelling.
      selection: ``'diverse'``, farthest-point sampling among the uncertain
        frames (:func:`chemtrain.active.diverse`); ``'top'``, the highest
        scores; ``'random'``, frames drawn at random from all recorded
        frames of the round's runs, uncertain or not (the baseline that
        active learning is measured against).
      stop_when_quiet: the run ends early once this many rounds in a row
        found no uncertain frame (and no explosion) in any MD run: the
        committee is sure wherever its MD goes, at these temperatures and
        this threshold. None: run all ``rounds``. Not with ``'random'``
        selection, which labels frames whether uncertain or not.
      seed: every random choice (MD velocities and noise, training order)
        follows from it and the round.
    """
    rounds: int = 5
    labels_per_round: int = 10
    ensemble_size: int = 4
    epochs_first: int = 30
    epochs_per_round: int = 10
    finetune_args: tuple = ()
    temperatures_K: tuple = (300.0,)
    md_steps: int = 1000
    timestep_fs: float = 2.0
    friction_per_fs: float = 0.02
    record_every: int = 10
    threshold: float = 2.0
    threshold_mode: str = "relative"
    stop_after: int | None = None
    max_force: float = 50.0
    min_distance: float | None = None
    keep_sane: int = 3
    selection: str = "diverse"
    stop_when_quiet: int | None = 2
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "finetune_args", tuple(str(a) for a in self.finetune_args))
        object.__setattr__(self, "temperatures_K", tuple(float(t) for t in self.temperatures_K))
        counts = {"rounds": 0, "labels_per_round": 1, "ensemble_size": 2, "epochs_first": 1,
                  "epochs_per_round": 1, "md_steps": 1, "record_every": 1, "keep_sane": 1}
        for name, least in counts.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"Settings.{name} must be an integer >= {least}, got {value!r}.")
        for name in ("stop_after", "stop_when_quiet"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"Settings.{name} must be None or an integer >= 1, got "
                                 f"{value!r}.")
        for name in ("timestep_fs", "friction_per_fs", "threshold", "max_force", "min_distance"):
            value = getattr(self, name)
            if name == "min_distance" and value is None:
                continue
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"Settings.{name} must be a positive number, got {value!r}.")
        if not self.temperatures_K or min(self.temperatures_K) <= 0:
            raise ValueError(f"Settings.temperatures_K must be positive temperatures (K), got "
                             f"{self.temperatures_K!r}.")
        if self.selection not in SELECTIONS:
            raise ValueError(f"Settings.selection must be one of {SELECTIONS}, got "
                             f"{self.selection!r}.")
        if self.threshold_mode not in MODES:
            raise ValueError(f"Settings.threshold_mode must be one of {MODES}, got "
                             f"{self.threshold_mode!r}.")
        for flag in ("--train_file", "--results_dir", "--member_models", "--ensemble_size",
                     "--max_num_epochs", "--seed", "--restart_latest"):
            if any(a == flag or a.startswith(flag + "=") for a in self.finetune_args):
                raise ValueError(f"Settings.finetune_args must not contain {flag}: the loop "
                                 f"sets it each round (see Settings' other fields).")

    @property
    def uncertain_per_run(self) -> int:
        return self.stop_after if self.stop_after is not None else 4 * self.labels_per_round

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict) -> "Settings":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Unknown settings {unknown}; known: {sorted(known)}.")
        return cls(**data)

    def differences(self, other: "Settings") -> list[str]:
        """The fields (but ``rounds``) in which ``other`` differs, as text."""
        a, b = self.to_json(), other.to_json()
        return [f"{k}: {json.dumps(a[k])} -> {json.dumps(b[k])}" for k in a
                if k != "rounds" and a[k] != b[k]]
