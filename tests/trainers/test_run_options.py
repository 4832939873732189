"""RunOptions: one value for what every trainer shares, upstream's keywords
beside it, and constructors of at most ten parameters beyond upstream's."""
import inspect

import jax.numpy as jnp
import optax
import pytest

from chemtrain.learn import ReuseRule
from chemtrain.trainers import (Difftre, DifftreParallel, EnsembleOfModels, ForceMatching,
                                InterleaveTrainers, RelativeEntropy, Reweighting, RunOptions)
from chemtrain.trainers.options import split_options

# upstream chemtrain 0.2.0's constructor names (inspect.signature in ../shared/bench's venv)
UPSTREAM = {
    "ForceMatching": {"init_params", "optimizer", "energy_fn_template", "nbrs_init", "gammas",
                      "error_fns", "weights_keys", "additional_targets", "feature_extract_fns",
                      "energy_fn_has_aux", "batch_per_device", "batch_cache", "full_checkpoint",
                      "disable_shmap", "penalty_fn", "convergence_criterion", "log_file",
                      "checkpoint_path"},
    "EnsembleOfModels": {"trainers", "ref_energy_fn_template"},
    "Difftre": {"init_params", "optimizer", "reweight_ratio", "adaptive_step_size_threshold",
                "sim_batch_size", "energy_fn_template", "full_checkpoint",
                "convergence_criterion", "checkpoint_path", "log_dir"},
    "DifftreParallel": {"key", "init_params", "optimizer", "energy_fn_template",
                        "simulator_template", "neighbor_fn", "timings", "state_kwargs",
                        "quantities", "targets", "observables", "initial_trajstates",
                        "reweight_ratio", "allowed_reduction", "step_size_scale",
                        "interior_points", "sim_batch_size", "full_checkpoint",
                        "target_loss_fns", "loss_fn", "vmap_batch", "set_key",
                        "resample_simstates", "convergence_criterion", "checkpoint_path",
                        "log_dir"},
    "RelativeEntropy": {"init_params", "optimizer", "reweight_ratio", "sim_batch_size",
                        "energy_fn_template", "convergence_criterion", "checkpoint_path",
                        "full_checkpoint"},
    "InterleaveTrainers": {"sequential", "checkpoint_base_path", "reference_energy_fn_template",
                           "full_checkpoint"},
    "Reweighting": set(),   # ours alone
}
# our committee takes ForceMatching's arguments where upstream's takes ForceMatching trainers
UPSTREAM["EnsembleOfModels"] |= UPSTREAM["ForceMatching"]
TRAINERS = [ForceMatching, EnsembleOfModels, Difftre, DifftreParallel, RelativeEntropy,
            Reweighting, InterleaveTrainers]


@pytest.mark.parametrize("cls", TRAINERS, ids=lambda c: c.__name__)
def test_at_most_ten_parameters_beyond_upstreams_names(cls):
    params = inspect.signature(cls).parameters.values()
    assert not [p for p in params if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    beyond = [p.name for p in params if p.name not in UPSTREAM[cls.__name__]]
    assert len(beyond) <= 10, (cls.__name__, beyond)
    assert "options" in beyond


def _fm(**kw):
    from problems import mlp_problem
    _, params, template, nbrs = mlp_problem()
    return ForceMatching(params, optax.adam(1e-3), template, nbrs, batch=2,
                         parallelism="single", **kw)


def test_upstream_keywords_and_options_fill_the_same_fields(tmp_path):
    tr = _fm(checkpoint_path=str(tmp_path / "a"), log_file=str(tmp_path / "m.jsonl"))
    assert tr.store.folder == str(tmp_path / "a")
    assert tr.reporter.log_file == str(tmp_path / "m.jsonl")
    tr = _fm(options=RunOptions(checkpoint_path=str(tmp_path / "b"), progress=False,
                                consistency_check_every=3))
    assert tr.store.folder == str(tmp_path / "b")
    assert tr.consistency_check_every == 3 and not tr.reporter.show
    dt = Difftre({"x": jnp.asarray(1.0)}, optax.sgd(0.1), reweight_ratio=0.5,
                 checkpoint_path=str(tmp_path / "c"),
                 options=RunOptions(name="mine", on_update=print))
    assert (dt.reweight_ratio, dt.name, dt.on_update, dt.store.folder) == (
        0.5, "mine", print, str(tmp_path / "c"))
    assert Difftre({"x": jnp.asarray(1.0)}, optax.sgd(0.1)).name == "difftre"
    assert RelativeEntropy({"x": jnp.asarray(1.0)}, optax.sgd(0.1),
                           reuse=ReuseRule(reweight_ratio=0.7)).reweight_ratio == 0.7


def test_a_field_given_twice_or_unused_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"ForceMatching: checkpoint_path given twice.*Give it "
                                         r"once"):
        _fm(checkpoint_path="a", options=RunOptions(checkpoint_path="b"))
    with pytest.raises(ValueError, match=r"ForceMatching does not use RunOptions field\(s\) "
                                         r"\['plot_file', 'on_update'\]"):
        _fm(options=RunOptions(plot_file="p.png", on_update=print))
    with pytest.raises(ValueError, match=r"Difftre does not use RunOptions field\(s\) "
                                         r"\['epoch_line'\]"):
        Difftre({"x": jnp.asarray(1.0)}, optax.sgd(0.1), options=RunOptions(epoch_line=str))
    with pytest.raises(ValueError, match=r"InterleaveTrainers does not use.*\['name'\]"):
        InterleaveTrainers(options=RunOptions(name="x"))
    with pytest.raises(ValueError, match=r"reweight_ratio given twice.*keyword reweight_ratio="
                                         r"0.5 and in reuse=ReuseRule\(reweight_ratio=0.7\)"):
        Difftre({"x": jnp.asarray(1.0)}, optax.sgd(0.1), reweight_ratio=0.5,
                reuse=ReuseRule(reweight_ratio=0.7))
    with pytest.raises(TypeError, match=r"options must be a chemtrain.trainers.RunOptions.*"
                                        r"got dict"):
        _fm(options={"progress": False})


def test_fields_are_checked_when_the_value_is_made():
    with pytest.raises(TypeError, match=r"on_update must be a function of one record.*got int"):
        RunOptions(on_update=1)
    with pytest.raises(TypeError, match=r"epoch_line must be a function of record -> str"):
        RunOptions(epoch_line="epoch")
    with pytest.raises(ValueError, match=r"consistency_check_every must be a whole number >= 1"):
        RunOptions(consistency_check_every=0)
    with pytest.raises(ValueError, match=r"reweight_ratio must be a number in \[0, 1\]"):
        ReuseRule(reweight_ratio=1.5)


def test_split_options_moves_only_run_fields():
    out = split_options({"sim_batch_size": -1, "progress": False, "checkpoint_path": "c",
                         "options": RunOptions(name="n")})
    assert out == {"sim_batch_size": -1, "checkpoint_path": "c",
                   "options": RunOptions(name="n", progress=False)}
    assert split_options({"log_file": "m"}, keep=("log_file",)) == {"log_file": "m"}
