"""Units. chemtrain works in nm, kJ/mol, ps and amu (so that 1 amu nm^2/ps^2
is 1 kJ/mol); convert at the edges with these factors (multiply)."""

ANGSTROM_TO_NM = 0.1
KCAL_TO_KJ = 4.184
EV_TO_KJ_PER_MOL = 96.48533212
BOLTZMANN_KJ_PER_MOL_K = 0.0083144626


def force_factor(energy_factor: float, length_factor: float) -> float:
    """Conversion factor for forces, given the energy and length factors.

    Forces are energies per length, so the factor is ``energy_factor /
    length_factor``; e.g. ``force_factor(EV_TO_KJ_PER_MOL, ANGSTROM_TO_NM)``
    (about 964.85) converts eV/Angstrom to kJ/mol/nm (multiply).

    Args:
      energy_factor: factor (multiply) from the source energy unit to the
        target one, usually kJ/mol (e.g. ``EV_TO_KJ_PER_MOL``).
      length_factor: factor (multiply) from the source length unit to the
        target one, usually nm (e.g. ``ANGSTROM_TO_NM``).

    Returns:
      The factor (multiply) from the source force unit to the target one.
    """
    return energy_factor / length_factor


def kT(temperature_kelvin: float) -> float:
    """Thermal energy kT in kJ/mol at a temperature in kelvin.

    chemtrain's state points take ``kT``, not a temperature: e.g.
    ``kT(300.0)`` is about 2.494 kJ/mol.

    Args:
      temperature_kelvin: the temperature in K (a number, or a numpy array
        for several temperatures).

    Returns:
      ``BOLTZMANN_KJ_PER_MOL_K * temperature_kelvin``, in kJ/mol.
    """
    return BOLTZMANN_KJ_PER_MOL_K * temperature_kelvin
