"""Units. chemtrain works in nm, kJ/mol, ps and amu (so that 1 amu nm^2/ps^2
is 1 kJ/mol); convert at the edges with these factors (multiply)."""

ANGSTROM_TO_NM = 0.1
KCAL_TO_KJ = 4.184
EV_TO_KJ_PER_MOL = 96.48533212
BOLTZMANN_KJ_PER_MOL_K = 0.0083144626


def force_factor(energy_factor: float, length_factor: float) -> float:
    """Factor for forces given the energy and length factors."""
    return energy_factor / length_factor


def kT(temperature_kelvin: float) -> float:
    """Thermal energy in kJ/mol."""
    return BOLTZMANN_KJ_PER_MOL_K * temperature_kelvin
