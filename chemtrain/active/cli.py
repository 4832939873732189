"""``chemtrain-active``: the on-the-fly active-learning loop from the shell.

    chemtrain-active --folder runs/al --seeds start.xyz --labelled seed_labels.xyz \\
        --oracle emt --rounds 5 -- --num_channels 16 --max_L 0
    chemtrain-active --folder runs/al --oracle emt            # continue it

Flags after ``--`` go to ``chemtrain-finetune`` every round (model sizes,
learning rate, ...). The oracle is ``emt`` (ASE's EMT) or ``module:name``, a
function of no arguments returning an ASE calculator (or a calculator class).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys

from .folder import FolderInUse
from .settings import MODES, SELECTIONS, Settings


def oracle_of(spec: str):
    """The oracle named on the command line (a function returning a calculator)."""
    if spec.lower() == "emt":
        from ase.calculators.emt import EMT
        return EMT
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"--oracle {spec!r}: give 'emt' or 'module:function', a function of "
                         f"no arguments returning an ASE calculator.")
    try:
        value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--oracle {spec!r}: {type(e).__name__}: {e}") from None
    if not callable(value):
        raise ValueError(f"--oracle {spec!r} is not callable: give a function returning an ASE "
                         f"calculator.")
    return value


def _count_or_none(text: str):
    return None if int(text) == 0 else int(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chemtrain-active", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--folder", required=True, help="the run's folder (a restart names it again)")
    p.add_argument("--oracle", help="'emt' or module:function returning an ASE calculator")
    p.add_argument("--seeds", help="structures MD starts from (a file ASE reads); new runs")
    p.add_argument("--labelled", help="seed labels (extxyz with REF_energy/REF_forces or a "
                                      "calculator's results); new runs")
    p.add_argument("--test_file", help="labelled test set: each round's test force RMSE")
    p.add_argument("--calibration_file", help="labelled set that scales the spread")
    d = Settings()
    for f in dataclasses.fields(Settings):
        if f.name in ("finetune_args", "temperatures_K", "selection", "threshold_mode"):
            continue
        kind = float if isinstance(getattr(d, f.name), float) or f.name == "min_distance" else int
        if f.name == "stop_when_quiet":
            p.add_argument("--stop_when_quiet", type=_count_or_none, default=d.stop_when_quiet,
                           help="end after this many rounds without an uncertain frame; "
                                "0: run all rounds")
            continue
        p.add_argument(f"--{f.name}", type=kind, default=getattr(d, f.name))
    p.add_argument("--temperatures_K", type=float, nargs="+", default=list(d.temperatures_K))
    p.add_argument("--selection", choices=SELECTIONS, default=d.selection)
    p.add_argument("--threshold_mode", choices=MODES, default=d.threshold_mode)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    finetune_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = parser()
    args = p.parse_args(own)
    from . import loop
    from .files import read_json
    import os
    new = not os.path.exists(os.path.join(args.folder, "state.json"))
    given = {a.split("=")[0][2:] for a in own if a.startswith("--")}
    fields = {f.name for f in dataclasses.fields(Settings)}
    try:
        if new:
            settings = Settings(**{k: v for k, v in vars(args).items() if k in fields
                                   and k != "finetune_args"}, finetune_args=finetune_args)
        else:
            old = read_json(os.path.join(args.folder, "settings.json"))
            changed = {k: getattr(args, k) for k in given & fields}
            settings = Settings.from_json({**old, **changed,
                                           **({"finetune_args": finetune_args}
                                              if finetune_args else {})})
        oracle = oracle_of(args.oracle) if args.oracle else None
        out = loop.run(args.folder, oracle=oracle, seeds=args.seeds, labelled=args.labelled,
                       settings=settings, test=args.test_file, calibration=args.calibration_file)
    except (ValueError, FolderInUse) as e:   # bad input, or a folder in use
        p.exit(2, f"chemtrain-active: error: {e}\n")
    last = out["rounds"][-1] if out["rounds"] else {}
    print(f"Done: {len(out['rounds'])} rounds, {last.get('labels')} labels in "
          f"{out['labelled']}; committee {out['members'][0]} ..."
          + (f" (stopped early: {out['stopped']})" if out.get("stopped") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
