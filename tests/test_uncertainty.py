"""chemtrain.uncertainty: calibration numbers on cases whose answer is known
by construction, selection against the members' own calculators (numpy),
and the error paths."""
import ase
import numpy as np
import pytest

from chemtrain.calculator import ChemtrainCalculator, CommitteeCalculator
from chemtrain.uncertainty import calibration, committee_forces, fit_scale, select


def _prediction(forces, spread):
    """A committee_forces entry whose two members sit at forces -+ spread
    (their std is exactly ``spread``)."""
    forces, spread = np.asarray(forces, float), np.asarray(spread, float)
    return {"forces": forces, "member_forces": np.stack([forces - spread, forces + spread])}


def test_calibration_on_known_cases():
    rng = np.random.default_rng(0)
    spreads = [np.full((4, 3), s) for s in (0.01, 0.02, 0.05, 0.1, 0.2)]
    # errors exactly 1.5 spreads: every component within 2 std, none within 1
    preds = [_prediction(np.zeros((4, 3)), s) for s in spreads]
    refs = [-1.5 * s for s in spreads]
    report = calibration(preds, refs)
    assert report["within"] == {1: 0.0, 2: 1.0, 3: 1.0}
    assert report["spearman"] == pytest.approx(1.0)          # error grows with the spread
    assert report["per_structure"]["actual"] == pytest.approx([1.5 * s[0, 0] for s in spreads])
    assert fit_scale(preds, refs) == pytest.approx(1.5)
    assert calibration(preds, refs, scale=1.5)["within"][1] == 1.0
    # errors that shrink as the spread grows rank the other way
    assert calibration(preds, refs[::-1])["spearman"] == pytest.approx(-1.0)
    # Gaussian errors of the predicted size: about 68/95/99.7 %
    spread = rng.uniform(0.05, 0.5, (4000, 3))
    preds = [_prediction(np.zeros((4000, 3)), spread)]
    report = calibration(preds, [rng.standard_normal((4000, 3)) * spread])
    assert abs(report["within"][1] - 0.683) < 0.02 and abs(report["within"][2] - 0.954) < 0.01
    assert report["miscalibration_area"] < 0.01
    with pytest.raises(ValueError, match="2 structures but 1 reference"):
        calibration(preds * 2, [np.zeros((4000, 3))])
    with pytest.raises(ValueError, match=r"reference forces of shape \(3, 3\)"):
        calibration(preds, [np.zeros((3, 3))])


@pytest.fixture(scope="module")
def lj_committee():
    from jax_md import space
    from chemtrain.models.pair import lennard_jones_template
    template = lennard_jones_template(space.free()[0], 0.85, 0.765)
    members = [{"sigma": s, "epsilon": e} for s, e in ((0.34, 1.0), (0.32, 1.2), (0.36, 0.8))]
    return template, members, CommitteeCalculator(template, members, 0.85, dtype="float64")


def _pool(n=6):
    """Argon clusters, some squeezed: there the members disagree most."""
    rng = np.random.default_rng(3)
    base = np.stack(np.meshgrid(*[np.arange(3)] * 3, indexing="ij"), -1).reshape(-1, 3)
    return [ase.Atoms("Ar27", positions=(base + rng.uniform(-0.1, 0.1, base.shape))
                      * (3.1 + 0.25 * (i % 3))) for i in range(n)]


def test_select_ranks_as_the_members_own_calculators_do(lj_committee):
    template, members, committee = lj_committee
    pool = _pool()
    singles = [ChemtrainCalculator(template, p, 0.85, dtype="float64") for p in members]
    want = []
    for atoms in pool:
        forces = []
        for calc in singles:
            a = atoms.copy()
            a.calc = calc
            forces.append(a.get_forces())
        want.append(np.sqrt(np.var(np.array(forces), axis=0).sum(-1)).max())
    picked = select(committee, pool, 3)
    np.testing.assert_array_equal(picked, np.argsort(-np.array(want), kind="stable")[:3])
    scores = [r["scores"]["forces_std"] for r in committee_forces(committee, pool)]
    np.testing.assert_allclose(scores, want, rtol=1e-9)


def test_select_refuses_bad_input(lj_committee):
    committee = lj_committee[2]
    pool = _pool(3)
    with pytest.raises(ValueError, match=r"from 1 to the pool's size \(3\), got 4"):
        select(committee, pool, 4)
    with pytest.raises(ValueError, match="by must be one of"):
        select(committee, pool, 1, by="variance")
    with pytest.raises(ValueError, match="Structure 1 of the pool has no positions"):
        select(committee, [pool[0], {"numbers": [18]}], 1)
    with pytest.raises(ValueError, match="Structure 0 of the pool has no positions"):
        select(committee, [ase.Atoms()], 1)


def test_meaningless_input_is_refused(lj_committee):
    """Input that gave numbers without meaning before: a committee of one
    model twice, a scale that is no scale, reference forces in kJ/mol/nm."""
    template, members, committee = lj_committee
    pool = _pool(3)
    twice = CommitteeCalculator(template, [members[0], members[0]], 0.85, dtype="float64")
    with pytest.raises(ValueError, match=r"members agree on every structure \(forces_std 0 on "
                                         r"all 3\)"):
        select(twice, pool, 1)
    preds = committee_forces(committee, pool)
    reference = []
    for atoms in pool:   # the first member's forces, eV/Angstrom
        a = atoms.copy()
        a.calc = ChemtrainCalculator(template, members[0], 0.85, dtype="float64")
        reference.append(a.get_forces())
    scale = fit_scale(preds, reference)
    assert np.isfinite(scale) and scale > 0
    for bad in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            calibration(preds, reference, scale=bad)
    in_kj_mol_nm = [f * 964.853 for f in reference]
    for fn in (fit_scale, calibration):
        with pytest.raises(ValueError, match=r"not in eV/Angstrom .* divided by 964\.85"):
            fn(preds, in_kj_mol_nm)
    with pytest.raises(ValueError, match="no spread to scale"):
        fit_scale(committee_forces(twice, pool), reference)


def test_calculator_cutoff_below_the_templates_range_is_refused(lj_committee):
    """The calculators compare their neighbor list's cutoff with the
    template's range (0.85 nm here): a 0.5 nm list misses every pair beyond."""
    template, members, _ = lj_committee
    with pytest.raises(ValueError, match=r"The calculator: the energy model reaches 0\.85 nm, "
                                         r"but the neighbor list holds pairs only up to 0\.5 nm"
                                         r".* Give cutoff= at least 0\.85 nm"):
        ChemtrainCalculator(template, members[0], 0.5)
    with pytest.raises(ValueError, match=r"reaches 0\.85 nm"):
        CommitteeCalculator(template, members, 0.5)
    calc = ChemtrainCalculator(template, members[0], None, dtype="float64")
    assert calc.model.cutoff == pytest.approx(8.5)   # the template's range, in Angstrom
    with pytest.raises(ValueError, match="does not state one"):
        ChemtrainCalculator(lambda p: template(p), members[0], None)


def test_miscalibration_area_against_its_integral():
    """Errors twice the predicted std: the observed coverage of the central
    interval of probability p is 2 Phi(z_p / 2) - 1; the area is the integral
    of its distance to p (scipy's quad), against the function's sample sum."""
    from scipy import integrate, stats
    from chemtrain.uncertainty import miscalibration_area
    rng = np.random.default_rng(1)
    std = rng.uniform(0.1, 1.0, 200_000)
    errors = 2.0 * std * rng.standard_normal(std.shape)

    def gap(p):
        z = stats.norm.ppf((1 + p) / 2)
        return abs(2 * stats.norm.cdf(z / 2) - 1 - p)
    want = integrate.quad(gap, 0, 1, limit=200)[0]
    assert 0.1 < want < 0.3
    assert miscalibration_area(errors, std) == pytest.approx(want, abs=3e-3)
    assert miscalibration_area(errors, 2.0 * std) < 3e-3              # scaled: calibrated
    assert miscalibration_area(np.full(10, 5.0), np.full(10, 1e-6)) == pytest.approx(0.5)
