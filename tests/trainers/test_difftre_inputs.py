"""Hostile DiffTRe input, as a new user would give it: every case ends in a
clear error (naming the argument and the fix) or in correct behaviour, and
nothing on disk is lost. Cheap systems: two bonded particles, eight
Lennard-Jones particles; most cases stop before any trajectory runs."""
import functools
import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax_md import partition, simulate, space

from chemtrain import quantity
from chemtrain.checkpoint import CheckpointError
from chemtrain.models.pair import harmonic_bond_template, lennard_jones_template
from chemtrain.neighbors import SmallCellError
from chemtrain.simulate import process_printouts
from chemtrain.trainers import TrainingError, RunOptions
from chemtrain.trainers.difftre import Difftre, DifftreParallel
from difftre_systems import bonded_pair, bonded_pair_args, pair_system, update_recorder
from chemtrain.trainers.options import split_options

SHORT = process_printouts(0.01, 2.1, 0.1, 0.2)   # 210 steps, 10 snapshots


def pair(**kw):
    return bonded_pair(1, timings=SHORT, **kw)


def pair_kwargs(**kw):
    return {"kT": np.array([2.56]), "mass": np.array([10.0]), **kw}


CUBE = np.stack(np.meshgrid(*[[0.6, 1.0]] * 3, indexing="ij"), -1).reshape(-1, 3)
TWO_SQUARES = np.stack(np.meshgrid([0.6, 1.0], [0.6, 1.0], [0.5, 1.5], indexing="ij"),
                       -1).reshape(-1, 3)   # 1 nm apart: each particle has 3 neighbors


def lj8(box=2.0, cutoff=0.9, template=None, quantities=None, targets=None, R0=CUBE, **kw):
    """Eight LJ particles (default: on the corners of a 0.4 nm cube), jax-md
    Dense list."""
    displacement, shift = space.periodic(box)
    args = dict(
        key=0, init_params={"sigma": jnp.asarray(0.34), "epsilon": jnp.asarray(1.0)},
        optimizer=optax.sgd(1e-4),
        energy_fn_template=template or lennard_jones_template(displacement, cutoff),
        simulator_template=functools.partial(simulate.nvt_langevin, shift_fn=shift, dt=0.005,
                                             kT=1.0, gamma=5.0),
        neighbor_fn=partition.neighbor_list(displacement, box, cutoff, format=partition.Dense),
        timings=process_printouts(0.005, 0.1, 0.05, 0.01),
        state_kwargs={"kT": np.array([1.0]), "mass": np.array([40.0])},
        quantities=quantities or {"energy": quantity.potential_energy()},
        targets=targets or {"energy": {"target": np.array([-1.0])}},
        reference_states=R0[None], progress=False)
    args.update(kw)
    return DifftreParallel(**split_options(args)), displacement


# -- silently wrong before: now errors or right ----------------------------------------

def test_pressure_needs_an_energy_that_forwards_perturbation():
    displacement, _, _, _, _ = pair_system()
    base = harmonic_bond_template(displacement, [[0, 1]])

    def ignores(p):        # accepts **kwargs, drops them: no virial
        energy = base({"k": 100 * p["scaled_b"], "r0": p["r_0"]})
        return lambda R, neighbor=None, **kw: energy(R, neighbor)

    def refuses(p):        # no **kwargs at all
        energy = base({"k": 100 * p["scaled_b"], "r0": p["r_0"]})
        return lambda R, neighbor=None: energy(R, neighbor)
    q = {"pressure": quantity.pressure(box=1.0)}
    t = {"pressure": {"target": np.array([1.0])}}
    with pytest.raises(ValueError, match="ignores jax-md's perturbation.*kinetic part alone"):
        pair(energy_fn_template=ignores, quantities=q, targets=t).initialize_trajstates()
    with pytest.raises(ValueError, match="perturbation=.*which it does not accept.*\\*\\*kwargs"):
        pair(energy_fn_template=refuses, quantities=q, targets=t).initialize_trajstates()


def test_box_narrower_than_twice_the_cutoff_is_refused():
    """An energy on a minimum-image list in a box narrower than twice its
    cutoff would miss periodic images (ForceMatching refuses it too)."""
    trainer, _ = lj8(box=1.6)
    with pytest.raises(SmallCellError, match=r"narrower than twice the cutoff \(0\.9 nm"):
        trainer.initialize_trajstates()
    # an energy that does not read the list (a bond) may use any box
    pair().initialize_trajstates()


def test_rdf_beyond_half_the_box_must_say_which_images():
    displacement, _, _, bins, _ = pair_system()
    records, on_update = update_recorder()
    trainer = pair(quantities={"rdf": quantity.rdf(displacement, bins, box=1.0)},
                   targets={"rdf": {"target": np.ones((1, 50))}}, on_update=on_update)
    trainer.initialize_trajstates()
    with pytest.raises(ValueError, match="exceeds half the box.*periodic_images='all'"):
        trainer.train(1)
    assert records == []


def test_restore_refuses_trajectories_of_reordered_state_points(tmp_path):
    a = bonded_pair(2, timings=SHORT)
    a.initialize_trajstates()
    a.save_trajstates(str(tmp_path / "t.npz"))
    swapped = {"kT": np.array([3.0, 2.56]), "mass": np.full(2, 10.0)}
    b = bonded_pair(2, timings=SHORT, state_kwargs=swapped)
    with pytest.raises(CheckpointError, match=r"state point 0 sampled with state_kwargs "
                                              r"\{'kT': 2\.56.*has \{'kT': 3\.0.*reordered"):
        b.load_trajstates(str(tmp_path / "t.npz"))
    assert b.trajstates == {}


@pytest.mark.parametrize("key,hint", [("Pressure", "pressure"), ("masses", "mass")])
def test_state_kwargs_nobody_reads_are_refused(key, hint):
    trainer = pair(state_kwargs=pair_kwargs(**{key: np.array([1.0])}))
    with pytest.raises(ValueError, match=rf"\['{key}'\] are read by nothing.*did you mean "
                                         rf"'{hint}'"):
        trainer.initialize_trajstates()


def test_simulator_partial_is_read_not_ignored():
    _, shift, _, _, _ = pair_system()
    langevin = functools.partial(simulate.nvt_langevin, shift_fn=shift, kT=2.56, gamma=0.5)
    with pytest.raises(ValueError, match="dt=0.005 ps.*time_step=0.01 ps.*0.5 times as long"):
        pair(simulator_template=functools.partial(langevin, dt=0.005))
    with pytest.raises(ValueError, match=r"passes \['gama'\] to nvt_langevin.*ignored"):
        pair(simulator_template=functools.partial(langevin, dt=0.01, gama=1.0))
    # mass in the partial (upstream's test does this; jax-md ignores it) is used
    trainer = pair(simulator_template=functools.partial(langevin, dt=0.01, mass=7.0),
                   state_kwargs={"kT": np.array([2.56])})
    trainer.initialize_trajstates()
    assert np.all(np.asarray(trainer.trajstates[0][0].sim_state.mass) == 7.0)
    with pytest.raises(ValueError, match="mass is given twice"):
        pair(simulator_template=functools.partial(langevin, dt=0.01, mass=7.0)
             ).initialize_trajstates()


def test_metric_in_place_of_a_displacement():
    displacement = space.periodic(2.0)[0]
    trainer, _ = lj8(template=lennard_jones_template(space.metric(displacement), 0.9))
    with pytest.raises(ValueError, match="looks like a metric|Is it a metric"):
        trainer.initialize_trajstates()


def test_absurd_reference_energy_names_the_metric_mistake():
    """jax-md's smap.pair_neighbor_list given a displacement where it takes a
    metric returns nonsense energies without a word."""
    from jax_md import energy, smap
    displacement = space.periodic(2.0)[0]

    def template(p):   # the mistake: displacement instead of its metric
        return smap.pair_neighbor_list(energy.lennard_jones, displacement,
                                       sigma=p["sigma"], epsilon=p["epsilon"])
    trainer, _ = lj8(template=template)
    with pytest.raises(ValueError, match="canonicalize_displacement_or_metric"):
        trainer.initialize_trajstates()


def test_jax_md_energy_with_nan_parameter_gradient_is_diagnosed(tmp_path):
    from jax_md import energy
    displacement = space.periodic(2.0)[0]

    def template(p):
        return energy.lennard_jones_neighbor_list(displacement, 2.0, sigma=p["sigma"],
                                                  epsilon=p["epsilon"], r_cutoff=0.9)[1]
    padded = partition.neighbor_list(displacement, 2.0, 0.9, format=partition.Sparse)
    trainer, _ = lj8(template=template, checkpoint_path=str(tmp_path), R0=TWO_SQUARES,
                     neighbor_fn=padded)
    trainer.initialize_trajstates()
    with pytest.raises(TrainingError, match="gradient finite: False.*Likely cause: The energy's "
                                            "gradient .* NaN on a neighbor list with padding"):
        trainer.train(1)


@pytest.mark.parametrize("gamma", [-1.0, np.nan, "1"])
def test_target_weight_must_be_a_nonnegative_number(gamma):
    with pytest.raises(ValueError, match=r"targets\['rdf'\]\['gamma'\] must be a finite number "
                                         r">= 0"):
        pair(targets={"rdf": {"target": np.ones((1, 50)), "gamma": gamma}})


def test_shared_log_file_is_refused_unless_continuing_that_run(tmp_path):
    log = tmp_path / "m.jsonl"
    a = pair(log_file=str(log), checkpoint_path=str(tmp_path / "a"))
    a.initialize_trajstates()
    a.train(1, checkpoint_freq=1)
    before = log.read_bytes()
    b = pair(log_file=str(log), checkpoint_path=str(tmp_path / "b"))
    b.initialize_trajstates()
    with pytest.raises(ValueError, match="already holds lines of another run"):
        b.train(1)
    assert log.read_bytes() == before
    c = pair(log_file=str(log), checkpoint_path=str(tmp_path / "a"))
    c.restore(str(tmp_path / "a" / "epoch_00001.npz"))
    c.train(1)
    runs = {json.loads(line)["run_id"] for line in log.read_text().splitlines()}
    assert len(runs) == 1 and len(log.read_text().splitlines()) == 2


# -- nothing on disk is lost -----------------------------------------------------------

def test_files_are_not_written_over(tmp_path):
    a = pair(checkpoint_path=str(tmp_path / "a"))
    a.initialize_trajstates()
    a.train(2, checkpoint_freq=1)
    ckpt, user = tmp_path / "a" / "epoch_00002.npz", tmp_path / "mine.npy"
    np.save(user, np.arange(5))
    kept = {p: p.read_bytes() for p in (ckpt, user)}
    for path in kept:
        with pytest.raises(FileExistsError, match="does not write over it.*overwrite=True"):
            a.save_trajstates(str(path))
    assert all(p.read_bytes() == b for p, b in kept.items())
    a.save_trajstates(str(tmp_path / "t.npz"))
    a.save_trajstates(str(tmp_path / "t.npz"))   # this run's own file: replaced
    # restoring epoch 1 and training on would overwrite this run's epoch 2
    b = pair(checkpoint_path=str(tmp_path / "a"))
    b.restore(str(tmp_path / "a" / "epoch_00001.npz"))
    with pytest.raises(CheckpointError, match="after epoch 1 \\(epoch_00002.npz\\).*overwrite"):
        b.train(1, checkpoint_freq=1)
    assert ckpt.read_bytes() == kept[ckpt]
    # a trajectory file given to restore says what it is
    with pytest.raises(CheckpointError, match="trajectory-state file.*load_trajstates"):
        b.restore(str(tmp_path / "t.npz"))


def test_renamed_parameters_and_other_list_formats_are_named(tmp_path):
    a = pair(checkpoint_path=str(tmp_path / "a"))
    a.initialize_trajstates()
    a.save_checkpoint(str(tmp_path / "k.npz"))
    renamed = pair(init_params={"r0": jnp.asarray(0.3), "scaled_b": jnp.asarray(1.5)},
                   checkpoint_path=str(tmp_path / "b"))
    with pytest.raises(CheckpointError, match=r"only in the checkpoint: \['r_0'\]; only in this "
                                              r"run: \['r0'\]"):
        renamed.restore(str(tmp_path / "k.npz"))
    displacement = pair_system()[0]
    sparse = pair(neighbor_fn=partition.neighbor_list(displacement, 1.0, 0.9,
                                                      format=partition.Sparse))
    with pytest.raises(CheckpointError, match="Dense neighbor list.*builds "
                                              "NeighborListFormat.Sparse"):
        sparse.load_trajstates(str(tmp_path / "k.npz"))


# -- poor errors before: now they name the argument and the fix -------------------------

def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"kT'\] must be one positive, finite number"):
        pair(state_kwargs=pair_kwargs(kT=np.array([np.nan])))
    for kT in (0.0, -1.0):
        with pytest.raises(ValueError, match="positive, finite"):
            pair(state_kwargs=pair_kwargs(kT=np.array([kT])))
    with pytest.raises(TypeError, match=r"Parameter \['r_0'\] has dtype int.*floating point"):
        pair(init_params={"r_0": jnp.asarray(0), "scaled_b": jnp.asarray(1.5)})
    with pytest.raises(TypeError, match="reference positions are float32.*float64"):
        pair(reference_states=np.zeros((1, 2, 3), np.float32))
    with pytest.raises(ValueError, match="vmap_batch must be a positive whole number"):
        pair(vmap_batch=-3)
    with pytest.raises(ValueError, match=r"plot_x\['rdf'\] has 3 values.*50"):
        pair(plot_x={"rdf": np.arange(3)})
    with pytest.raises(ValueError, match="is a folder"):
        pair(log_file=".")
    with pytest.raises(TypeError, match="key must be an integer seed or a JAX random key"):
        pair(key="0")
    # an integer seed is a key
    assert np.array_equal(pair(key=3).key, bonded_pair(1, timings=SHORT).key)
    trainer = pair()
    for epochs in (2.5, "2"):
        with pytest.raises(TypeError, match="max_epochs must be a whole number"):
            trainer.train(epochs)


def test_bad_functions_are_named():
    displacement = pair_system()[0]
    base = harmonic_bond_template(displacement, [[0, 1]])
    vector = lambda p: lambda R, neighbor=None, **kw: jnp.sum(R, axis=1)  # noqa: E731
    with pytest.raises(ValueError, match=r"returns an array of shape \(2,\)"):
        pair(energy_fn_template=vector).initialize_trajstates()
    pairwise = lambda p: (None, base({"k": 100.0, "r0": 0.3}))  # noqa: E731
    with pytest.raises(TypeError, match="returned a tuple.*neighbor_list"):
        pair(energy_fn_template=pairwise).initialize_trajstates()
    records, on_update = update_recorder()
    trainer = pair(targets={"rdf": {"target": np.ones((1, 50)),
                                    "loss_fn": lambda p, t: (p - t) ** 2}}, on_update=on_update)
    trainer.initialize_trajstates()
    with pytest.raises(ValueError, match=r"loss_fn'\] returned an array of shape \(50,\)"):
        trainer.train(1)
    assert records == []


def test_too_small_neighbor_list_says_so():
    displacement = space.periodic(2.0)[0]
    tiny = partition.neighbor_list(displacement, 2.0, 0.9, format=partition.Dense,
                                   capacity_multiplier=0.3)
    trainer, _ = lj8(neighbor_fn=tiny)
    with pytest.raises(Exception, match="allocates too little room.*capacity_multiplier"):
        trainer.initialize_trajstates()


def test_adf_with_too_few_neighbor_slots_is_diagnosed(tmp_path):
    displacement = space.periodic(2.0)[0]
    sparse = partition.neighbor_list(displacement, 2.0, 0.9, format=partition.Sparse)
    adf = quantity.adf(displacement, quantity.adf_discretization(0.6, 20), box=2.0,
                       max_neighbors=1)
    trainer, _ = lj8(neighbor_fn=sparse, quantities={"adf": adf},
                     targets={"adf": {"target": np.ones((1, 20))}},
                     checkpoint_path=str(tmp_path))
    trainer.initialize_trajstates()
    with pytest.raises(TrainingError, match="Likely cause.*adf.*more than max_neighbors=1.*raise "
                                            "max_neighbors"):
        trainer.train(1)


def test_difftre_upstream_style_seed_and_args():
    """Difftre (upstream's add_statepoint style) takes the same checks."""
    args = bonded_pair_args(1)
    trainer = Difftre(args["init_params"], optax.sgd(0.1), key=0,
                      options=RunOptions(progress=False))
    with pytest.raises(ValueError, match="dt=0.02 ps"):
        trainer.add_statepoint(args["energy_fn_template"],
                               functools.partial(args["simulator_template"], dt=0.02),
                               args["neighbor_fn"], SHORT, {"kT": 2.56},
                               args["quantities"], args["reference_states"][0],
                               targets={"rdf": {"target": np.ones(50)}})


def test_save_checkpoint_after_or_inside_a_failing_on_update_says_what_happened(tmp_path):
    """Issue 37: after an on_update exception, save_checkpoint claimed that
    'update N failed' and pointed to an error state that does not exist; the
    same came from save_checkpoint called inside on_update."""
    import os
    calls = []

    def raising(record):
        calls.append(record["update"])
        if len(calls) == 2:
            raise ZeroDivisionError("the user's callback")
    trainer = bonded_pair(1, on_update=raising, checkpoint_path=str(tmp_path / "a"))
    trainer.initialize_trajstates()
    with pytest.raises(ZeroDivisionError) as e:
        trainer.train(3)
    assert "raised by on_update after update 1, which was applied" in " ".join(e.value.__notes__)
    with pytest.raises(RuntimeError, match=r"Epoch 1 did not complete \(on_update raised "
                                           r"ZeroDivisionError after update 1\).*call train\(\) "
                                           r"again") as e:
        trainer.save_checkpoint(str(tmp_path / "k.npz"))
    assert "error state" not in str(e.value)
    assert not os.path.exists(tmp_path / "a") or \
        not any("error_state" in f for f in os.listdir(tmp_path / "a"))

    def saving(record):
        inside.save_checkpoint(str(tmp_path / "inside.npz"))
    inside = bonded_pair(1, on_update=saving, checkpoint_path=str(tmp_path / "b"))
    inside.initialize_trajstates()
    with pytest.raises(RuntimeError, match=r"save_checkpoint was called from inside on_update: "
                                           r"epoch 0 is still running"):
        inside.train(1)
    assert not os.path.exists(tmp_path / "inside.npz")


@pytest.mark.parametrize("piece", ["reduce_on_plateau", "ema"])
def test_force_matching_optimizer_pieces_are_refused(piece, tmp_path):
    """A plateau or moving average given to a reweighting trainer: nothing
    fed the plateau and nothing used the average (the factor stayed 1 and
    the trained parameters were simulated), without a word."""
    from chemtrain import learn
    from chemtrain.trainers import RelativeEntropy, Reweighting
    from mean_energy import mean_energy_objective
    opt = getattr(learn, piece)(optax.adam(1e-3))
    params = {"sigma": jnp.asarray(0.34), "epsilon": jnp.asarray(1.0)}
    match = rf"optimizer holds chemtrain\.learn\.{piece}, which only ForceMatching"
    with pytest.raises(ValueError, match="DifftreParallel: the " + match):
        lj8(optimizer=opt, checkpoint_path=str(tmp_path / "a"))
    with pytest.raises(ValueError, match="Difftre: the " + match):
        Difftre(params, opt, checkpoint_path=str(tmp_path / "b"),
                options=RunOptions(progress=False))
    with pytest.raises(ValueError, match="RelativeEntropy: the " + match):
        RelativeEntropy(params, opt, checkpoint_path=str(tmp_path / "c"),
                        options=RunOptions(progress=False))
    with pytest.raises(ValueError, match=match):
        Reweighting(mean_energy_objective(), 0, params, opt,
                    options=RunOptions(progress=False, checkpoint_path=str(tmp_path / "d")))
