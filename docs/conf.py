"""Sphinx configuration of chemtrain's documentation (``sphinx-build -W -b html docs docs/_build``)."""
import os
import shutil
import sys

sys.path.insert(0, os.path.abspath(".."))
# Building the API pages imports chemtrain: keep JAX on the CPU and quiet.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "chemtrain"
author = "the chemtrain developers"
copyright = "2026, the chemtrain developers"
release = "0.3.0.dev0"

extensions = [
    "myst_parser",              # pages in Markdown
    "sphinx.ext.autodoc",       # API reference from docstrings
    "sphinx.ext.autosummary",   # one page per public function and class
    "sphinx.ext.napoleon",      # Google-style "Args:" / "Returns:" / "Raises:" sections
    "sphinx.ext.viewcode",      # links from the reference to the source
    "sphinx.ext.mathjax",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "guides/_flags.md", "screenshots"]
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3

autosummary_generate = True
autodoc_default_options = {"members": True}   # no "Bases:": the bases are private
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True   # "Attributes:" as fields: NamedTuple fields are not listed twice

html_theme = "furo"
html_title = "chemtrain"
html_static_path = []
templates_path = ["_templates"]

#: the public packages and modules of the API reference, with a line on each
API = {
    "chemtrain.trainers": "Trainers: force matching, DiffTRe, relative entropy, fused training.",
    "chemtrain.learn": "Pure functions: losses and optimizer pieces for force matching, the "
                       "reweighting objectives, state points, step sizes.",
    "chemtrain.models": "Energy templates: pair potentials, priors, freezing.",
    "chemtrain.models.mace": "MACE: the model, its parameters, mace-torch files.",
    "chemtrain.models.nequip": "NequIP (SevenNet's network): the model, its parameters, "
                               "SevenNet checkpoints.",
    "chemtrain.data": "Datasets in memory and in HDF5 files.",
    "chemtrain.neighbors": "Neighbor lists and precomputed graphs.",
    "chemtrain.simulate": "Simulations that DiffTRe reweights, and reference data.",
    "chemtrain.quantity": "Observables: RDF, ADF, pressure, density.",
    "chemtrain.parallel": "The parallel strategies and their failure handling.",
    "chemtrain.calculator": "ASE calculators, single models and committees.",
    "chemtrain.uncertainty": "Committee uncertainty: active-learning selection and calibration.",
    "chemtrain.active": "On-the-fly active learning: MD with a committee, labels where it is "
                        "unsure, retraining; one resumable folder.",
    "chemtrain.checkpoint": "Plain-data checkpoint files.",
    "chemtrain.units": "Unit conversions.",
    "chemtrain.compile_cache": "JAX's persistent compilation cache: where, how large, off.",
    "chemtrain.finetune": "The chemtrain-finetune command line.",
}


def _public_names(module_name):
    import importlib
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items() if not n.startswith("_")
                 and getattr(v, "__module__", "") == module_name and callable(v)]
    return list(names)


def _write_api_pages():
    """One page per public package listing its ``__all__``, so the reference follows the code."""
    import importlib
    here = os.path.dirname(os.path.abspath(__file__))
    for module_name, line in API.items():
        names = _public_names(module_name)
        body = [module_name, "=" * len(module_name), "", line, "",
                f".. automodule:: {module_name}", "   :no-members:", "",
                f".. currentmodule:: {module_name}", "",
                ".. autosummary::", "   :toctree: generated", "   :nosignatures:", ""]
        module = importlib.import_module(module_name)
        constants = [n for n in names if not callable(getattr(module, n))]
        body += [f"   {n}" for n in names if n not in constants]
        if constants:   # values, not pages: a constant's docstring would be its type's
            body += ["", "Constants", "---------", "", ".. list-table::", ""]
            for n in constants:
                body += [f"   * - ``{n}``", f"     - ``{getattr(module, n)!r}``"]
        text = "\n".join(body) + "\n"
        path = os.path.join(here, "api", f"{module_name}.rst")
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as f:
                f.write(text)


#: chemtrain-finetune flags that mean what mace-torch's ``mace_run_train`` flag of the same name means
MACE_TORCH_FLAGS = {
    "train_file", "valid_file", "test_file", "valid_fraction", "energy_key", "forces_key",
    "stress_key", "foundation_model", "foundation_head", "E0s", "energy_weight",
    "forces_weight", "stress_weight",
    "num_channels", "max_L", "max_ell", "correlation", "r_max", "num_interactions",
    "num_radial_basis", "num_cutoff_basis", "radial_MLP", "MLP_irreps", "batch_size",
    "max_num_epochs", "lr", "seed", "default_dtype", "results_dir", "restart_latest", "name",
    "scheduler", "lr_factor", "scheduler_patience", "lr_scheduler_gamma", "patience", "ema",
    "ema_decay", "loss", "huber_delta", "freeze", "multiheads_finetuning", "pt_train_file",
    "weight_pt_head", "real_pt_data_ratio_threshold", "force_mh_ft_lr", "swa", "start_swa",
    "swa_lr", "swa_energy_weight", "swa_forces_weight", "swa_stress_weight", "amsgrad",
    "clip_grad", "weight_decay"}


def _write_flag_table():
    """The table of every chemtrain-finetune flag, from its argument parser."""
    from chemtrain.finetune.cli import parser
    rows = ["| flag | default | mace_run_train | meaning |", "|---|---|---|---|"]
    for action in parser()._actions:
        flags = [f for f in action.option_strings if f.startswith("--")]
        if not flags or flags[0] == "--help":
            continue
        name = flags[0][2:]
        default = "" if action.default in (None, False) else f"`{action.default}`"
        same = f"`--{name}`" if name in MACE_TORCH_FLAGS else "(chemtrain only)"
        meaning = " ".join((action.help or "").split()).replace("|", "\\|")
        rows.append(f"| `{flags[0]}` | {default} | {same} | {meaning} |")
    text = "\n".join(rows) + "\n"
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guides", "_flags.md")
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


# autosummary never removes the pages of names that left an __all__: start clean
shutil.rmtree(os.path.join(os.path.dirname(os.path.abspath(__file__)), "api", "generated"),
              ignore_errors=True)
_write_api_pages()
_write_flag_table()
